"""`kvjax bench decode` at toy size measures the step it claims to (speed is not tested)."""

from __future__ import annotations

import pytest

from kvjax.bench import decode
from kvjax.bench.base import harness
from kvjax.cache.config import CacheConfig
from kvjax.cache.kinds import bytes_per_token


def test_bench_decode_times_a_step_on_a_filled_cache(bench_model):
  result = decode.bench_decode(bench_model, batch=2, prompt=8, new_tokens=4, repeats=1)
  assert result["decode_step_ms"] > 0 and result["tokens_per_s"] > 0
  # float32 weights, 4 bytes each: q, k, v, out 32x32 + 2 x 32x16 + 32x32; gate, up, down 3 x 32x64;
  # lm_head 32x64: 11,264 -> 45,056 bytes. Cache: 2 rows x 8 positions x (K and V, 2 kv heads x 8
  # dims, 4 bytes) = 2,048 bytes.
  assert result["decode_step_bytes"] == 45_056 + 2_048


def test_bench_decode_takes_an_int8_cache(bench_model):
  """`kvjax bench decode --set cache.dtype=int8`: a whole decode step over an int8 cache,
  whose bytes (values and scales) the step's byte count takes."""
  int8 = CacheConfig(dtype="int8")
  result = decode.bench_decode(bench_model, batch=2, prompt=8, new_tokens=1, repeats=1, cache_config=int8)
  assert result["decode_step_ms"] > 0 and result["cache"]["dtype"] == "int8"
  assert result["decode_step_bytes"] == harness.weight_bytes(bench_model) + 2 * 8 * bytes_per_token(bench_model, int8)


def test_run_refuses_a_generation_past_the_context(bench_model):
  """64 positions: a 60-token prompt and 8 new tokens need 67, refused before the model is built."""
  with pytest.raises(ValueError, match="--prompt 60 \\+ 8 new tokens need 67 cache positions"):
    decode.run(decode.DecodeConfig(model=bench_model), batch=1, prompt=60, new=8, repeats=1)
