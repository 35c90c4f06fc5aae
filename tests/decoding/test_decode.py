"""Oracles for the preallocated KV cache: cached decoding equals the full forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.decoding import baselines
from kvjax.decoding import decode
from kvjax.decoding.decode import until_stop
from kvjax.decoding.sampling import Sampling
from conftest import init_params, tiny_config


def random_tokens(shape, vocab=64, seed=1):
  return np.asarray(jax.random.randint(jax.random.key(seed), shape, 0, vocab), np.int32)


def test_prefill_and_decode_match_full_forward(variant):
  """Ragged prefill then decode steps give the full forward's logits at every position."""
  _, model, params = variant
  seqs = random_tokens((3, 24))
  full = np.asarray(model.apply({"params": params}, seqs))
  lengths = np.array([10, 4, 7])
  prompts = np.where(np.arange(10)[None] < lengths[:, None], seqs[:, :10], 0)
  logits, cache = kvjax.prefill(model, params, prompts, lengths, max_len=32)
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(logits[row, :n], full[row, :n], atol=1e-5)
  for step in range(12):
    positions = lengths + step
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), positions])
    np.testing.assert_allclose(logits, full[np.arange(3), positions], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, lengths + 12)
  last, last_cache = kvjax.prefill(model, params, prompts, lengths, max_len=32, logits="last")
  np.testing.assert_allclose(last, full[np.arange(3), lengths - 1], atol=1e-5)
  assert last_cache.lengths.tolist() == lengths.tolist()


def test_ragged_batch_rows_match_running_alone(variant):
  _, model, params = variant
  prompts = random_tokens((3, 9), seed=2)
  lengths = np.array([9, 3, 6])
  batched = np.asarray(kvjax.generate(model, params, prompts, lengths, 8))
  for row, n in enumerate(lengths):
    alone = kvjax.generate(model, params, prompts[row : row + 1, :n], np.array([n]), 8)
    np.testing.assert_array_equal(batched[row], np.asarray(alone)[0])


def test_bf16_cache_stays_close_to_fp32():
  """A bfloat16 cache (fp32 compute, CacheConfig.dtype) keeps next-token logits within 0.05 of
  the fp32 cache of the same model, and generate takes it too."""
  model, params = init_params(tiny_config(2))
  bf16 = CacheConfig(dtype="bfloat16")
  seqs = random_tokens((2, 16), seed=3)
  lengths = np.array([8, 8])
  l32, c32 = kvjax.prefill(model, params, seqs[:, :8], lengths, 16)
  l16, c16 = kvjax.prefill(model, params, seqs[:, :8], lengths, 16, cache_config=bf16)
  assert c16.layers["layers_0"]["attn"]["k"].dtype == jnp.uint16  # bfloat16's bits
  assert c32.layers["layers_0"]["attn"]["k"].dtype == jnp.float32
  worst = 0.0
  for pos in range(8, 14):
    l32, c32 = kvjax.decode_step(model, params, c32, seqs[:, pos])
    l16, c16 = kvjax.decode_step(model, params, c16, seqs[:, pos])
    np.testing.assert_allclose(l16, l32, atol=5e-2)
    worst = max(worst, float(np.abs(l16 - l32).max()))
  assert worst > 0  # the bfloat16 cache is read as stored, rounded
  first = np.argmax(
    np.asarray(kvjax.prefill(model, params, seqs[:, :8], lengths, 16, logits="last", cache_config=bf16)[0]), -1
  )
  np.testing.assert_array_equal(kvjax.generate(model, params, seqs[:, :8], lengths, 1, cache_config=bf16)[:, 0], first)


def test_baselines_agree_with_preallocated_cache():
  model, params = init_params(tiny_config(2))
  prompts = random_tokens((2, 7), seed=4)
  lengths = np.array([7, 5])
  expected = np.asarray(kvjax.generate(model, params, prompts, lengths, 10))
  np.testing.assert_array_equal(baselines.generate_nocache(model, params, prompts, lengths, 10), expected)
  np.testing.assert_array_equal(baselines.generate_concat(model, params, prompts, lengths, 10), expected)
  np.testing.assert_array_equal(
    baselines.generate_doubling(model, params, prompts, lengths, 10, initial_capacity=8), expected
  )


def test_cache_bytes_follow_num_kv_heads():
  sizes = {}
  for kv in (4, 2, 1):
    model, params = init_params(tiny_config(kv))
    _, cache = kvjax.prefill(model, params, np.ones((2, 4), np.int32), np.array([4, 4]), 32)
    sizes[kv] = cache.nbytes
    per_token = model.config.num_layers * 2 * kv * model.config.head_dim * 4  # K and V, float32
    assert sizes[kv] == 2 * 32 * per_token == 2 * 32 * kinds.bytes_per_token(model.config)
  assert sizes[4] == 2 * sizes[2] == 4 * sizes[1]


def test_generate_compiles_once_per_bucket():
  model, params = init_params(tiny_config(2))
  decode._generate.clear_cache()
  for n in (5, 9, 12):  # all in the 16-token bucket
    sampling = Sampling(temperature=0.5)
    kvjax.generate(
      model, params, random_tokens((2, n)), np.array([n, n - 2]), 6, sampling=sampling, rng=jax.random.key(n)
    )
  # other settings are traced values, not a new compilation
  kvjax.generate(model, params, random_tokens((2, 3)), np.array([3, 3]), 6, sampling=Sampling(top_k=5, top_p=0.9))
  assert decode._generate._cache_size() == 1


def test_stop_tokens_end_each_row_at_its_first_stop():
  model, params = init_params(tiny_config(2))
  prompts = random_tokens((3, 6), seed=7)
  free = np.asarray(kvjax.generate(model, params, prompts, np.array([6, 6, 6]), 12))
  stops = (int(free[0, 2]), int(free[1, 5]))
  stopped = np.asarray(kvjax.generate(model, params, prompts, np.array([6, 6, 6]), 12, stop_ids=stops))
  for row, kept in enumerate(until_stop(stopped, stops)):
    hits = np.flatnonzero(np.isin(free[row], stops))
    end = hits[0] if hits.size else 12
    np.testing.assert_array_equal(kept, free[row, :end])
    if hits.size:
      np.testing.assert_array_equal(stopped[row, : end + 1], free[row, : end + 1])
      assert (stopped[row, end:] == free[row, end]).all()  # a stopped row repeats its stop token
  with pytest.raises(ValueError, match="stop token id 64"):
    kvjax.generate(model, params, prompts, np.array([6, 6, 6]), 4, stop_ids=(1, 64))


def test_eos_stops_rows_and_pads_with_eos():
  model, params = init_params(tiny_config(2))
  prompts = random_tokens((2, 6), seed=5)
  free = np.asarray(kvjax.generate(model, params, prompts, np.array([6, 6]), 10))
  eos = int(free[0, 3])
  stopped = np.asarray(kvjax.generate(model, params, prompts, np.array([6, 6]), 10, stop_ids=eos))
  for row in range(2):
    hits = np.flatnonzero(free[row] == eos)
    end = hits[0] + 1 if hits.size else 10
    np.testing.assert_array_equal(stopped[row, :end], free[row, :end])
    assert (stopped[row, end:] == eos).all()


def test_bad_inputs_raise_before_compute():
  model, params = init_params(tiny_config(2))  # max_len 64, vocab 64
  ok = np.ones((1, 4), np.int32)
  with pytest.raises(ValueError, match="max_len"):
    kvjax.prefill(model, params, np.ones((1, 40), np.int32), np.array([40]), max_len=32)
  with pytest.raises(ValueError, match="max_len=64"):
    kvjax.generate(model, params, ok, np.array([4]), 62)
  with pytest.raises(ValueError, match="token id 64 at row 0, position 2"):
    kvjax.generate(model, params, np.array([[1, 2, 64, 3]]), np.array([4]), 2)
  with pytest.raises(ValueError, match="token id -1"):
    kvjax.prefill(model, params, np.array([[-1, 2]]), np.array([2]), 8)
  with pytest.raises(ValueError, match="empty prompt"):
    kvjax.generate(model, params, ok, np.array([0]), 2)
  with pytest.raises(ValueError, match="lengths must be"):
    kvjax.prefill(model, params, ok, np.array([4, 4]), 8)
  with pytest.raises(ValueError, match="exceeds the 4 tokens"):
    kvjax.prefill(model, params, ok, np.array([5]), 8)
  with pytest.raises(ValueError, match="max_new_tokens"):
    kvjax.generate(model, params, ok, np.array([4]), 0)
  with pytest.raises(ValueError, match=r"sampling must be a kvjax.Sampling, got \{'temperature': 1.0\}"):
    kvjax.generate(model, params, ok, np.array([4]), 2, sampling={"temperature": 1.0})
  _, cache = kvjax.prefill(model, params, ok, np.array([4]), max_len=5)
  with pytest.raises(ValueError, match="token id 99 at row 0"):
    kvjax.decode_step(model, params, cache, np.array([99]))
  _, cache = kvjax.decode_step(model, params, cache, np.array([1]))
  with pytest.raises(ValueError, match="cache is full: row 0 holds 5 tokens"):
    kvjax.decode_step(model, params, cache, np.array([1]))
