"""The benchmarks run end to end at toy size and compare what they claim to (speed is not tested)."""

from __future__ import annotations

from kvjax.bench import benchmarks, mla, paged, quant
from kvjax.cache.config import CacheConfig
from kvjax.cache.kinds import bytes_per_token
from kvjax.config import ModelConfig

TINY = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=64)


def test_bench_paged_compares_equal_caches():
  """The paged and contiguous caches hold the same K/V, so their first steps agree."""
  result = paged.bench_paged(TINY, batch=2, repeats=2, context=64, page_size=8)
  assert result["first_step_max_logit_diff"] < 1e-5
  assert result["context"] == 64 and result["steps"] == 8 and result["paged_over_contiguous"] > 0


def test_bench_decode_times_a_step_on_a_filled_cache():
  result = benchmarks.bench_decode(TINY, batch=2, prompt=8, new_tokens=4, repeats=1)
  assert result["decode_step_ms"] > 0 and result["tokens_per_s"] > 0
  assert 0 < result["decode_step_bytes"]


def test_bench_nocache_baselines_give_the_cached_tokens():
  result = benchmarks.bench_nocache(TINY, prompt=4, new_token_counts=(6,), concat_max=6, repeats=1)
  row = result["rows"][0]
  assert row["nocache_same_tokens"] and row["doubling_same_tokens"] and row["concat_same_tokens"]


def test_bench_mla_compares_equal_bytes_and_equal_latents():
  """The MLA model caches as many bytes per token as the GQA one, and its absorbed and expanded
  reads of the same latents give the same first step."""
  result = mla.bench_mla(TINY, batch=2, repeats=2, context=32, rope_dims=8)
  assert result["kv_bytes_per_token"]["mla"] == result["kv_bytes_per_token"]["gqa"]
  assert result["mla_model"]["kv_latent_rank"] == 24 and result["first_step_max_logit_diff"] < 1e-4
  assert result["mla_over_gqa"] > 0


def test_bench_quant_compares_equal_caches():
  """The float32 cache holds the int8 cache's dequantized values, so the two steps agree."""
  result = quant.bench_quant(TINY, batch=2, context=40, repeats=1)
  assert result["max_output_diff"] < 1e-5
  # int8 data plus a float32 scale per (position, kv head) for K and for V: (H + 4) / (4 H) of float32
  assert result["int8_cache_bytes"] * 4 * TINY.head_dim == result["float32_cache_bytes"] * (TINY.head_dim + 4)
  # Whole decode steps: the int8 cache holds the float32 cache's values quantized; its bytes as counted.
  assert result["decode_first_step_max_logit_diff"] < 0.05 and result["int8_decode_step_ms"] > 0
  assert result["decode_cache_bytes"] == {
    name: 2 * (40 + 2) * bytes_per_token(TINY, CacheConfig(dtype=name)) for name in ("float32", "int8")
  }


def test_bench_decode_takes_an_int8_cache():
  """`kvjax bench decode --set cache.dtype=int8`: a whole decode step over an int8 cache,
  whose bytes (values and scales) the step's byte count takes."""
  int8 = CacheConfig(dtype="int8")
  result = benchmarks.bench_decode(TINY, batch=2, prompt=8, new_tokens=1, repeats=1, cache_config=int8)
  assert result["decode_step_ms"] > 0 and result["cache"]["dtype"] == "int8"
  assert result["decode_step_bytes"] == benchmarks.weight_bytes(TINY) + 2 * 8 * bytes_per_token(TINY, int8)
