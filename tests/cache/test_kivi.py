"""KIVI's layout (CacheConfig(dtype="kivi2" / "kivi4")): what it stores is a NumPy reading of the
paper's rule (keys per channel over groups of 32 tokens, values per token over groups of 32
channels, the partial last group exact in float), and decoding through it is consistent: the
logits at a position are the same whether the row got there by one prefill or by a ragged prefill,
an extend and decode steps (the store depends only on the positions held)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import KNorm
from kvjax.model.transformer import cache_layers
from conftest import init_params, tiered, tiny_config

G = 32


@functools.cache
def model_params():
  return init_params(tiny_config(2, d_model=64, num_heads=2, max_len=96))  # head_dim 32


def kivi_by_hand(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
  """Asymmetric quantize-dequantize of x's groups along `axis` (the range includes 0)."""
  levels = 2**bits - 1
  low = np.minimum(x.min(axis=axis, keepdims=True), 0)
  step = (np.maximum(x.max(axis=axis, keepdims=True), 0) - low) / levels
  safe = np.where(step > 0, step, 1)
  zero = np.clip(np.round(-low / safe), 0, levels)
  return (np.clip(np.round(x / safe) + zero, 0, levels) - zero) * step


def stored_by_hand(k: np.ndarray, v: np.ndarray, n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
  """k, v [K, n, H] of one row -> what KIVI holds: full groups quantized, the rest exact."""
  k, v = k.copy(), v.copy()
  full = n // G * G
  for s in range(0, full, G):
    k[:, s : s + G] = kivi_by_hand(k[:, s : s + G], bits, axis=1)  # per channel over the group's tokens
  heads, _, width = v.shape
  grouped = v[:, :full].reshape(heads, full, width // G, G)
  v[:, :full] = kivi_by_hand(grouped, bits, axis=3).reshape(heads, full, width)  # per token
  return k, v


@pytest.mark.parametrize("dtype", tiered(["kivi2", "kivi4"], ("kivi2",)))
def test_kivi_stores_the_papers_quantization_and_an_exact_residual(dtype):
  """Layer 0 (whose K/V depend on the tokens alone) after a ragged prefill, an extend and decode
  steps: positions of filled groups are the NumPy quantization of the float cache's K/V, the
  partial group's are exact."""
  model, params = model_params()
  bits = int(dtype[-1])
  seqs = np.random.default_rng(0).integers(0, 64, (3, 80)).astype(np.int32)
  prompt = np.array([40, 20, 31])
  caches = []
  for dtype_ in ("float32", dtype):
    config = CacheConfig(dtype=dtype_)
    _, cache = kvjax.prefill(model, params, seqs[:, :40], prompt, 80, cache_config=config)
    chunk = np.array([5, 12, 1])
    tokens = np.stack([np.pad(seqs[r, n : n + c], (0, 12 - c)) for r, (n, c) in enumerate(zip(prompt, chunk))])
    _, cache = kvjax.extend(model, params, cache, tokens, chunk)
    for step in range(3):
      _, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), prompt + chunk + step])
    caches.append(cache)
  full, kivi = caches
  assert kivi.layout == "kivi" and kivi.codec.bits == bits
  lengths = np.asarray(kivi.lengths)
  np.testing.assert_array_equal(lengths, [48, 35, 35])
  layer_full, layer_kivi = cache_layers(full.layers)[0], cache_layers(kivi.layers)[0]
  k_float = np.asarray(layer_full["k"]).swapaxes(2, 3)  # [B, K, S, H]
  v_float = np.asarray(layer_full["v"])
  read = kivi.readable(layer_kivi, kivi.lengths)
  for row, n in enumerate(lengths):
    want_k, want_v = stored_by_hand(k_float[row, :, :n], v_float[row, :, :n], n, bits)
    np.testing.assert_allclose(np.asarray(read["k"])[row, :, :n], want_k, atol=1e-5, err_msg=f"row {row}")
    np.testing.assert_allclose(np.asarray(read["v"])[row, :, :n], want_v, atol=1e-5, err_msg=f"row {row}")
    residual = slice(n // G * G, n)
    np.testing.assert_array_equal(np.asarray(read["k"])[row, :, residual], k_float[row, :, residual])
    assert not np.allclose(want_k[:, :G], k_float[row, :, :G], atol=1e-3)  # the full group is quantized


@pytest.mark.parametrize("dtype", tiered(["kivi2", "kivi4"], ("kivi4",)))
def test_decoding_through_kivi_is_consistent_with_one_prefill(dtype):
  """The logits of a decode step at position p equal the last logits of one prefill of p + 1
  tokens through a fresh KIVI cache (the groups quantized are those of the positions held), and
  a 4-bit store stays near the float cache."""
  model, params = model_params()
  seqs = np.random.default_rng(1).integers(0, 64, (2, 72)).astype(np.int32)
  prompt = np.array([30, 33])
  config = CacheConfig(dtype=dtype)
  _, cache = kvjax.prefill(model, params, seqs[:, :33], prompt, 72, cache_config=config)
  for step in range(5):  # row 0 fills its first group at step 1
    positions = prompt + step
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(2), positions])
    for row in range(2):
      n = positions[row] + 1
      want, _ = kvjax.prefill(model, params, seqs[row : row + 1, :n], np.array([n]), 72, cache_config=config)
      np.testing.assert_allclose(logits[row], want[0, n - 1], atol=2e-5, err_msg=f"step {step} row {row}")
  float_logits, _ = kvjax.prefill(model, params, seqs[:, :66], np.array([66, 66]), 72)
  kivi_logits, _ = kvjax.prefill(model, params, seqs[:, :66], np.array([66, 66]), 72, cache_config=config)
  gap = np.abs(kivi_logits - float_logits).max()
  assert 1e-4 < gap < (0.5 if dtype == "kivi4" else 2.0), gap


def test_what_kivi_cannot_hold_is_refused():
  for changes, message in (
    (dict(layout="paged"), r"dtype='kivi2' is KIVI's own layout .* layout='paged' with press=None cannot hold"),
    (dict(press=KNorm()), r"dtype='kivi2' is KIVI's own layout .* press=KNorm"),
  ):
    with pytest.raises(ValueError, match=message):
      CacheConfig(dtype="kivi2", **changes)
  with pytest.raises(ValueError, match=r"CacheConfig.layout='kivi' stores \('kivi2', 'kivi4'\) codes"):
    CacheConfig(layout="kivi", dtype="int4")
  with pytest.raises(ValueError, match="a kivi4 cache quantizes groups of 32 channels.* head_dim|cached k is 16 wide"):
    kinds.create(tiny_config(2, d_model=64), CacheConfig(dtype="kivi4"), 1, 8)
  with pytest.raises(ValueError, match=r"KIVI\) stores global K/V layers only; this model has window=\(4, 0\)"):
    kinds.create(
      tiny_config(2, d_model=64, num_heads=2), CacheConfig(dtype="kivi4", window=(4, 0), sink_tokens=1), 1, 8
    )
