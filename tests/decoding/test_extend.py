"""Oracles for appending to a non-empty cache: chunked prefill == one-shot prefill == full forward."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from conftest import init_params, tiered, tiny_config

TOTAL = np.array([20, 9, 15])  # tokens per row, fed in ragged chunks
CHUNKS = [np.array([5, 0, 7]), np.array([1, 4, 1]), np.array([8, 5, 0]), np.array([6, 0, 7])]
PAGE_SIZE, MAX_PAGES, NUM_PAGES = 4, 8, 30


def random_tokens(shape, seed):
  return np.asarray(jax.random.randint(jax.random.key(seed), shape, 0, 64), np.int32)


def empty_cache(kind: str, config) -> kvjax.KVCache:
  if kind == "contiguous":
    return kvjax.ContiguousCache.create(config, 3, MAX_PAGES * PAGE_SIZE)
  table = np.random.default_rng(0).permutation(np.arange(1, NUM_PAGES))[: 3 * MAX_PAGES].reshape(3, MAX_PAGES)
  cache = kvjax.PagedCache.create(config, NUM_PAGES, PAGE_SIZE, 3, MAX_PAGES)
  return cache.with_rows(table, np.zeros(3, np.int32))


def chunk(seqs, held, lengths):
  """Right-padded [3, max(lengths)] chunk of each row's next lengths[b] tokens after held[b]."""
  out = np.zeros((3, max(int(lengths.max()), 1)), np.int32)
  for row in range(3):
    out[row, : lengths[row]] = seqs[row, held[row] : held[row] + lengths[row]]
  return out


@pytest.mark.parametrize("kind", tiered(["contiguous", "paged"], ("paged",)))
def test_chunked_prefill_matches_one_shot_and_full_forward(variant, kind):
  _, model, params = variant
  seqs = random_tokens((3, 24), seed=1)
  full = np.asarray(model.apply({"params": params}, seqs))
  one_shot, _ = kvjax.extend(
    model, params, empty_cache(kind, model.config), chunk(seqs, np.zeros(3, int), TOTAL), TOTAL
  )
  cache, held = empty_cache(kind, model.config), np.zeros(3, int)
  for lengths in CHUNKS:
    logits, cache = kvjax.extend(model, params, cache, chunk(seqs, held, lengths), lengths)
    for row in range(3):
      span = slice(held[row], held[row] + lengths[row])
      np.testing.assert_allclose(logits[row, : lengths[row]], full[row, span], atol=1e-5)
      np.testing.assert_allclose(logits[row, : lengths[row]], one_shot[row, span], atol=1e-5)
    held = held + lengths
  np.testing.assert_array_equal(cache.lengths, TOTAL)
  # Decoding goes on from the chunked cache as from a one-shot prefill.
  logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), TOTAL])
  np.testing.assert_allclose(logits, full[np.arange(3), TOTAL], atol=1e-5)


def test_multi_turn_continuation_matches_full_forward():
  """Prompt, a few generated tokens, then the user's next turn appended with extend."""
  model, params = init_params(tiny_config(1))
  seqs = random_tokens((3, 30), seed=2)
  full = np.asarray(model.apply({"params": params}, seqs))
  first = np.array([6, 3, 8])
  logits, cache = kvjax.prefill(model, params, chunk(seqs, np.zeros(3, int), first), first, 32, logits="last")
  np.testing.assert_allclose(logits, full[np.arange(3), first - 1], atol=1e-5)
  held = first
  for _ in range(4):
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), held])
    np.testing.assert_allclose(logits, full[np.arange(3), held], atol=1e-5)
    held = held + 1
  turn = np.array([9, 2, 5])
  logits, cache = kvjax.extend(model, params, cache, chunk(seqs, held, turn), turn, logits="last")
  np.testing.assert_allclose(logits, full[np.arange(3), held + turn - 1], atol=1e-5)


def test_chunk_that_overflows_is_refused_before_compute_and_loses_nothing():
  model, params = init_params(tiny_config(2))
  seqs = random_tokens((3, 24), seed=3)
  cache = kvjax.ContiguousCache.create(model.config, 3, 16)
  _, cache = kvjax.extend(
    model, params, cache, chunk(seqs, np.zeros(3, int), np.array([4, 12, 2])), np.array([4, 12, 2])
  )
  with pytest.raises(ValueError, match="cache is full: row 1 holds 12 tokens and 5 more do not fit its 16 positions"):
    kvjax.extend(model, params, cache, np.ones((3, 5), np.int32), np.array([5, 5, 5]))
  with pytest.raises(ValueError, match="negative length: row 2"):
    kvjax.extend(model, params, cache, np.ones((3, 2), np.int32), np.array([1, 1, -1]))
  with pytest.raises(ValueError, match="empty prompt: row 1"):
    kvjax.extend(model, params, cache, np.ones((3, 2), np.int32), np.array([1, 0, 1]), logits="last")
  with pytest.raises(ValueError, match="tokens have 2 rows but the cache has 3"):
    kvjax.extend(model, params, cache, np.ones((2, 2), np.int32), np.array([1, 1]))
  # A row near its end takes a chunk padded past it: only its valid tokens are written.
  logits, cache = kvjax.extend(
    model, params, cache, chunk(seqs, np.array([4, 12, 2]), np.array([12, 4, 1])), np.array([12, 4, 1])
  )
  full = np.asarray(model.apply({"params": params}, seqs[:, :16]))
  np.testing.assert_allclose(logits[1, :4], full[1, 12:16], atol=1e-5)
  np.testing.assert_allclose(logits[0, :12], full[0, 4:16], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [16, 16, 3])
  # A chunk padded wider than the whole cache is fine while the valid tokens fit.
  wide = np.zeros((3, 20), np.int32)
  wide[2, :5] = seqs[2, 3:8]
  logits, cache = kvjax.extend(model, params, cache, wide, np.array([0, 0, 5]))
  np.testing.assert_allclose(logits[2, :5], np.asarray(model.apply({"params": params}, seqs[:, :8]))[2, 3:8], atol=1e-5)
