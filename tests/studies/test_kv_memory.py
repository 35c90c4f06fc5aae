"""The KV-memory study end to end on its tiny config, plus its workload and config checks."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cache.kinds import bytes_per_token
from kvjax.cli.run import load_config
from kvjax.config import ModelConfig
from kvjax.studies import kv_memory
from kvjax.studies.kv_memory import CSV_FIELDS, KVMemoryStudy, WorkloadConfig, make_workload

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.tier2  # the whole study end to end
def test_tiny_study_writes_its_results(tmp_path):
  study = load_config(ROOT / "configs/kv_memory/tiny.py")
  assert study.job == "kv_memory"
  lines = []
  kv_memory.run(study, tmp_path, lines.append)
  assert [line.split(":")[1] for line in lines] == [
    f" {p} float32" for p in ("max_len", "doubling", "paged8", "paged16", "paged32")
  ]

  with open(tmp_path / "kv_memory.csv") as f:
    rows = {row["policy"]: row for row in csv.DictReader(f)}
  assert list(rows) == ["max_len", "doubling", "paged8", "paged16", "paged32"]
  assert set(next(iter(rows.values()))) == set(CSV_FIELDS)
  workload = make_workload(study.workload, study.model.max_len, study.model.vocab_size)
  max_len = study.model.max_len
  for name, row in rows.items():
    assert int(row["budget_tokens"]) == study.budget_tokens
    assert int(row["generated_tokens"]) == sum(n for _, n in workload)  # every request completed
    assert int(row["identical_outputs"]) == len(workload)
    assert 0 < float(row["utilisation"]) <= 1
    assert int(row["peak_concurrent"]) <= study.num_slots
  # Preallocating max_len positions caps concurrency at budget / max_len; pages lift the cap.
  assert int(rows["max_len"]["peak_concurrent"]) == study.budget_tokens // max_len
  assert int(rows["paged8"]["peak_concurrent"]) > int(rows["max_len"]["peak_concurrent"])
  for name in ("doubling", "paged8", "paged16"):
    assert float(rows[name]["utilisation"]) > float(rows["max_len"]["utilisation"])

  report = (tmp_path / "kv_memory.md").read_text()
  assert all(f"| {name} |" in report for name in rows) and "96.3%" in report
  assert (tmp_path / "kv_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  headline = json.loads((tmp_path / "kv_memory_summary.json").read_text())
  assert headline["paged_policy"] == "paged16"
  assert headline["paged_utilisation"] == pytest.approx(float(rows["paged16"]["utilisation"]))
  want = int(rows["paged16"]["peak_concurrent"]) / int(rows["max_len"]["peak_concurrent"])
  assert headline["peak_concurrent_over_max_len"] == pytest.approx(want)


def test_cpu_config_is_valid():
  study = load_config(ROOT / "configs/kv_memory/cpu.py")
  assert study.page_sizes == (8, 16, 32) and study.budget_tokens % study.model.max_len == 0


def test_workload_is_seeded_long_tailed_and_fits():
  config = WorkloadConfig(num_requests=400, prompt_median=40, output_median=60, seed=3)
  first = make_workload(config, 256, 100)
  again = make_workload(config, 256, 100)
  assert all((a == b).all() and m == n for (a, m), (b, n) in zip(first, again))
  lengths = [p.size + n - 1 for p, n in first]
  assert max(lengths) <= 256 and min(p.size for p, _ in first) >= 1
  outputs = sorted(n for _, n in first)
  assert outputs[-len(outputs) // 20] > 3 * outputs[len(outputs) // 2]  # top 5% beyond 3x the median
  assert all(((p >= 0) & (p < 100)).all() for p, _ in first)


def test_bad_study_configs_name_the_field():
  with pytest.raises(ValueError, match="not a multiple of page size 32"):
    KVMemoryStudy(model=ModelConfig(max_len=64), budget_tokens=1000, page_sizes=(8, 32), baseline_page_size=8)
  with pytest.raises(ValueError, match="cannot hold one request"):
    KVMemoryStudy(model=ModelConfig(max_len=1024), budget_tokens=512)
  with pytest.raises(ValueError, match="KVMemoryStudy.job must be 'kv_memory'"):
    KVMemoryStudy(job="train")
  with pytest.raises(ValueError, match="WorkloadConfig.prompt_sigma"):
    WorkloadConfig(prompt_sigma=-1.0)
  with pytest.raises(ValueError, match="page_sizes must be a non-empty tuple"):
    dataclasses.replace(KVMemoryStudy(model=ModelConfig(max_len=64)), page_sizes=())


@pytest.mark.tier2  # the study run end to end
def test_quantized_formats_hold_more_requests_within_the_same_bytes(tmp_path):
  """int8 pages within the float32 budget's bytes: more token slots, at least as many requests at
  once, and the rows name their format."""
  tiny = load_config(ROOT / "configs/kv_memory/tiny.py")
  study = dataclasses.replace(
    tiny, model=tiny.model.replace(head_dim=32), page_sizes=(16,), cache_dtypes=("int8",), baselines=False
  )
  rows = kv_memory.run(study, tmp_path)
  assert [(r["policy"], r["cache_dtype"]) for r in rows] == [("paged16", "float32"), ("paged16", "int8")]
  own, int8 = rows
  assert own["budget_tokens"] == study.budget_tokens
  assert (
    int8["budget_bytes"]
    <= own["budget_bytes"]
    < int8["budget_bytes"] + 16 * bytes_per_token(study.model, CacheConfig(dtype="int8"))
  )
  assert int8["budget_tokens"] == 16 * (study.budget_tokens * 128 // (16 * 36))  # (32 + 4) bytes vs 4 x 32
  assert int8["peak_concurrent"] >= own["peak_concurrent"]
  with pytest.raises(ValueError, match=r"cache_dtypes\[0\]: CacheConfig.dtype must be one of"):
    dataclasses.replace(tiny, cache_dtypes=("int3",))
