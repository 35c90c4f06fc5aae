"""`kvjax bench quant` at toy size compares what it claims to (speed is not tested)."""

from __future__ import annotations

from kvjax.bench import quant
from kvjax.cache.config import CacheConfig
from kvjax.cache.kinds import bytes_per_token


def test_bench_quant_compares_equal_caches(bench_model):
  """The float32 cache holds the int8 cache's dequantized values, so the two steps agree."""
  result = quant.bench_quant(bench_model, batch=2, context=40, repeats=1)
  assert result["max_output_diff"] < 1e-5
  # int8 data plus a float32 scale per (position, kv head) for K and for V: (H + 4) / (4 H) of float32
  assert result["int8_cache_bytes"] * 4 * bench_model.head_dim == result["float32_cache_bytes"] * (
    bench_model.head_dim + 4
  )
  # Whole decode steps: the int8 cache holds the float32 cache's values quantized; its bytes as counted.
  assert result["decode_first_step_max_logit_diff"] < 0.05 and result["int8_decode_step_ms"] > 0
  assert result["decode_cache_bytes"] == {
    name: 2 * (40 + 2) * bytes_per_token(bench_model, CacheConfig(dtype=name)) for name in ("float32", "int8")
  }
