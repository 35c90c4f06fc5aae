"""`kvjax bench codecs` at toy size reports what it claims to (speed is not tested)."""

from __future__ import annotations

import pytest

from kvjax.bench import codecs


def test_bench_codecs_counts_each_codecs_bytes(bench_model):
  result = codecs.bench_codecs(bench_model, codecs=("int4", "int4+hadamard"), batch=2, context=16, repeats=1)
  rows = result["codecs"]
  assert list(rows) == ["float32", "int4", "int4+hadamard"]
  layers, kv, h = bench_model.num_layers, bench_model.num_kv_heads, bench_model.head_dim
  # K and V per layer and kv head: float32 4 H bytes, int4 H / 2 and a float32 step and zero point
  # per group of min(H, 32) elements.
  per_vector = {"float32": 4 * h, "int4": h // 2 + 8 * (h // min(h, 32))}
  per_vector["int4+hadamard"] = per_vector["int4"]  # the rotation stores nothing more
  for name, row in rows.items():
    assert row["bytes_per_position"] == 2 * layers * kv * per_vector[name]
    assert row["bytes_ratio"] == pytest.approx(per_vector[name] / per_vector["float32"])
    assert row["target_ratio"] == pytest.approx(1.3 * row["bytes_ratio"])
    assert row["attention_met"] == (row["attention_ratio"] <= row["target_ratio"])
    assert row["step_met"] == (row["step_ratio"] <= 1.0)
    assert row["kernel"] and row["step_ms"] > 0 and row["attention_ms"] > 0
  assert rows["float32"]["step_ratio"] == rows["float32"]["attention_ratio"] == 1.0


def test_bench_codecs_times_kivi_through_its_xla_read(bench_model):
  model = bench_model.replace(d_model=64, num_heads=2, num_kv_heads=1, head_dim=32)  # head_dim 32: one KIVI group
  rows = codecs.bench_codecs(model, codecs=("kivi2",), batch=2, context=40, repeats=1)["codecs"]
  # 2 bits per element, and a float32 step and zero point per 32 channels (values) or per channel
  # per 32 tokens (keys): 8 + 8 bytes a vector of 32, against float32's 128.
  assert rows["kivi2"]["bytes_per_position"] == 2 * 16
  assert not rows["kivi2"]["kernel"] and rows["kivi2"]["step_ms"] > 0 and rows["kivi2"]["attention_ms"] > 0


def test_bench_codecs_takes_one_weight_format():
  with pytest.raises(ValueError, match="one format"):
    codecs.run(codecs.CodecsConfig(), codecs=["int4"], batch=1, context=8, repeats=1, weights=["int8", "float32"])
