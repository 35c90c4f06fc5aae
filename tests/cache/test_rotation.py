"""CacheConfig(rotation="hadamard"): keys and values stored rotated, queries rotated in and the
output turned back. Without quantization it is the unrotated cache to float rounding, through
prefill, extend and decode on every layout; quantized, it is the forward over R^T decode(encode(R x))
(the rotation checked against scipy's Hadamard matrix, not kvjax's)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import kvjax
from kvjax.cache import kinds, rotation
from kvjax.cache.codec import codec
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import KNorm, SnapKV, make_press
from kvjax.model.attention import NoCache, new_keys
from conftest import init_params, tiered, tiny_config
from oracles import StoredForward, forward

LENGTHS = np.array([7, 3, 5])


@functools.cache
def model_params(num_kv_heads: int):
  return init_params(tiny_config(num_kv_heads, d_model=64, num_heads=4, max_len=32))  # head_dim 16


class RotatedStoredForward(NoCache):
  """The plain forward pass with each layer's k and v as a rotated cache of `codec` holds them,
  turned back: H decode(encode(H x)), H scipy's normalized Hadamard matrix (symmetric)."""

  def __init__(self, codec_, batch: int):
    self.codec, self.lengths = codec_, jnp.zeros((batch,), jnp.int32)

  def attend(self, stored, query, q_positions, new, span, backend):
    width = new["k"].shape[-1]
    h = jnp.asarray(scipy.linalg.hadamard(width) / np.sqrt(width), jnp.float32)
    back = {name: self.codec.roundtrip(x @ h) @ h for name, x in new.items()}
    return stored, query.attend(back, new_keys(q_positions, span))


def test_the_hadamard_matrix_is_orthogonal_symmetric_and_blocked():
  for width in (8, 16, 64):
    np.testing.assert_allclose(rotation.hadamard(width), scipy.linalg.hadamard(width) / np.sqrt(width), atol=1e-7)
  blocked = rotation.hadamard(24)  # 24 = 3 x 8: three 8-wide blocks
  np.testing.assert_allclose(blocked[8:16, 8:16], scipy.linalg.hadamard(8) / np.sqrt(8), atol=1e-7)
  assert not blocked[:8, 8:].any()
  np.testing.assert_allclose(blocked @ blocked, np.eye(24), atol=1e-6)
  with pytest.raises(
    ValueError, match=r"rotation='hadamard' rotates blocks .* at least 8; the model's head_dim is 12 wide"
  ):
    kinds.create(tiny_config(2, d_model=48), CacheConfig(rotation="hadamard"), 1, 8)
  with pytest.raises(ValueError, match=r"CacheConfig.rotation must be one of \('hadamard',\), got 'givens'"):
    CacheConfig(rotation="givens")
  with pytest.raises(ValueError, match=r"rotation='hadamard' rotates keys and values .* caches \['latent'"):
    kinds.create(tiny_config(2, kv_latent_rank=16, positions="learned"), CacheConfig(rotation="hadamard"), 1, 8)
  with pytest.raises(ValueError, match=r"press='expected_attention' reads key and query channels .* rotation=None"):
    CacheConfig(rotation="hadamard", press=make_press("expected_attention", compression_ratio=0.5))


@pytest.mark.parametrize(
  "layout, num_kv_heads",
  tiered([("contiguous", 4), ("contiguous", 2), ("contiguous", 1), ("paged", 2)], [("contiguous", 1), ("paged", 2)]),
  ids=str,
)
def test_a_float_rotated_cache_is_the_forward_pass(layout, num_kv_heads):
  """Ragged prefill, a ragged extend and decode steps through a float32 cache that stores rotated
  vectors: the plain forward's logits to float rounding (q.k and the output are invariant)."""
  model, params = model_params(num_kv_heads)
  seqs = np.random.default_rng(0).integers(0, 64, (3, 16)).astype(np.int32)
  full = forward(model, params, seqs)
  config = CacheConfig(layout=layout, dtype="float32", rotation="hadamard", page_size=4)
  logits, cache = kvjax.prefill(model, params, seqs[:, :7], LENGTHS, 16, cache_config=config)
  assert cache.rotation == "hadamard"
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(logits[row, :n], full[row, :n], atol=1e-5)
  chunk = np.array([2, 4, 1])
  tokens = np.stack([np.pad(seqs[r, n : n + c], (0, 4 - c)) for r, (n, c) in enumerate(zip(LENGTHS, chunk))])
  logits, cache = kvjax.extend(model, params, cache, tokens, chunk)
  for row, (n, c) in enumerate(zip(LENGTHS, chunk)):
    np.testing.assert_allclose(logits[row, :c], full[row, n : n + c], atol=1e-5)
  positions = LENGTHS + chunk
  for step in range(4):
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), positions + step])
    np.testing.assert_allclose(logits, full[np.arange(3), positions + step], atol=1e-5, err_msg=f"step {step}")


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_a_quantized_rotated_cache_is_the_forward_over_what_it_stores(dtype):
  """Decode steps through the decode kernel's (contiguous, int4) route with rotated queries and
  outputs: the forward over H decode(encode(H k)), which differs from the unrotated codec's."""
  model, params = model_params(2)
  seqs = np.random.default_rng(1).integers(0, 64, (3, 16)).astype(np.int32)
  want = forward(model, params, seqs, RotatedStoredForward(codec(dtype), 3))
  plain = forward(model, params, seqs, StoredForward(codec(dtype), 3))
  assert np.abs(want - plain).max() > 1e-3
  config = CacheConfig(dtype=dtype, rotation="hadamard")
  logits, cache = kvjax.prefill(model, params, seqs[:, :7], LENGTHS, 16, cache_config=config)
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(logits[row, :n], want[row, :n], atol=1e-4)
  for step in range(6):
    positions = LENGTHS + step
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), positions])
    np.testing.assert_allclose(logits, want[np.arange(3), positions], atol=1e-4, err_msg=f"step {step}")


@pytest.mark.parametrize("press", [KNorm(compression_ratio=0.5), SnapKV(compression_ratio=0.5, window=2)])
def test_presses_score_a_rotated_cache_as_the_unrotated_one(press):
  """Key norms and q.k are invariant under the rotation: a press keeps the same positions, and
  decoding continues with the same logits."""
  model, params = model_params(2)
  seqs = np.random.default_rng(2).integers(0, 64, (3, 14)).astype(np.int32)
  runs = []
  for rotation_ in (None, "hadamard"):
    config = CacheConfig(press=press, rotation=rotation_, dtype="float32")
    _, cache = kvjax.prefill(model, params, seqs[:, :10], np.array([10, 8, 9]), 14, cache_config=config)
    held = [np.asarray(layer["attn"]["positions"]) for layer in cache.layers.values()]
    steps = []
    for step in range(3):
      logits, cache = kvjax.decode_step(model, params, cache, seqs[:, 10 + step])
      steps.append(logits)
    runs.append((held, steps))
  for a, b in zip(runs[0][0], runs[1][0]):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-5)
