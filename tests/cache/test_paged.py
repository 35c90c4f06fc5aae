"""Oracles for the paged KV cache: paged prefill / decode give the contiguous cache's logits."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cache.layouts import paged
from kvjax.cache.config import CacheConfig
from kvjax.cache.pages import NULL_PAGE
from kvjax.model.transformer import cache_layers
from kvjax.serving.allocator import PageAllocator
from conftest import VARIANTS, init_params, tiny_config

PAGE_SIZE = 4
MAX_PAGES = 8  # 32 positions, the contiguous cache's max_len below
NUM_PAGES = 30
LENGTHS = np.array([10, 4, 7])


@functools.cache
def model_params(num_kv_heads: int = 2):
  return init_params(tiny_config(num_kv_heads))


def random_tokens(shape, seed):
  return np.array(jax.random.randint(jax.random.key(seed), shape, 0, 64), np.int32)


def new_cache(config, table=None, lengths=None, paged_read="gather") -> kvjax.PagedCache:
  cache_config = CacheConfig(layout="paged", page_size=PAGE_SIZE, paged_read=paged_read)
  cache = kvjax.PagedCache.create(config, NUM_PAGES, PAGE_SIZE, 3, MAX_PAGES, cache_config)
  if table is None:
    return cache
  return cache.with_rows(table, np.zeros(3, np.int32) if lengths is None else lengths)


def scattered_table(seed: int) -> np.ndarray:
  """Every row owns MAX_PAGES pages drawn at random from the pool (never the null page)."""
  pages = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))[: 3 * MAX_PAGES]
  return pages.reshape(3, MAX_PAGES).astype(np.int32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_matches_contiguous(variant):
  """Ragged prefill and 12 decode steps through scattered pages: same logits as the contiguous
  cache, and nothing is written outside the pages the rows own (except the null page)."""
  model, params = model_params(VARIANTS[variant])
  seqs = random_tokens((3, 24), seed=1)
  prompts = np.where(np.arange(10)[None] < LENGTHS[:, None], seqs[:, :10], 0)
  table = scattered_table(seed=0)
  want, contiguous = kvjax.prefill(model, params, prompts, LENGTHS, max_len=MAX_PAGES * PAGE_SIZE)
  got, cache = kvjax.extend(model, params, new_cache(model.config, table), prompts, LENGTHS)
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(got[row, :n], want[row, :n], atol=1e-5)
  for step in range(12):
    tokens = seqs[np.arange(3), LENGTHS + step]
    want, contiguous = kvjax.decode_step(model, params, contiguous, tokens)
    got, cache = kvjax.decode_step(model, params, cache, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, LENGTHS + 12)
  untouched = np.setdiff1d(np.arange(1, NUM_PAGES), table)
  for layer in cache_layers(cache.layers):
    for pool in layer.values():
      assert not np.asarray(pool)[:, untouched].any()


def test_fork_copy_on_write_matches_contiguous():
  """Row 2 forks row 0 mid-page; both then decode different tokens. The shared partial page is
  copied on first write, so each matches a contiguous cache holding its own sequence."""
  model, params = model_params()
  prompts = random_tokens((3, 10), seed=3)
  prompts[2] = prompts[0]
  alloc = PageAllocator(NUM_PAGES, PAGE_SIZE)
  for row in range(3):
    alloc.allocate(row, int(LENGTHS[row]))
  _, cache = kvjax.extend(
    model, params, new_cache(model.config, alloc.page_table(range(3), MAX_PAGES)), prompts, LENGTHS
  )
  alloc.free(2)
  alloc.fork(0, "child")
  rows = [0, 1, "child"]
  lengths = np.array([LENGTHS[0], LENGTHS[1], LENGTHS[0]])
  contiguous_lengths = lengths.copy()
  _, contiguous = kvjax.prefill(model, params, prompts, contiguous_lengths, max_len=MAX_PAGES * PAGE_SIZE)
  feed = random_tokens((6, 3), seed=4)
  copies_made = 0
  for step in range(6):
    for seq in rows:
      copies = alloc.append(seq)
      copies_made += len(copies)
      if copies:
        cache = cache.copy_pages(*zip(*copies))
    cache = cache.with_rows(alloc.page_table(rows, MAX_PAGES), lengths + step)
    want, contiguous = kvjax.decode_step(model, params, contiguous, feed[step])
    got, cache = kvjax.decode_step(model, params, cache, feed[step])
    np.testing.assert_allclose(got, want, atol=1e-5)
  assert copies_made == 1  # the parent's first write; the child then owns the original alone
  alloc.check()
  for seq in rows:
    alloc.free(seq)
  assert alloc.num_free == alloc.num_usable


def test_pallas_kernel_matches_gather():
  """The Pallas fast path (interpreted on CPU) gives the gather path's logits."""
  pytest.importorskip(
    "jax.experimental.pallas.ops.gpu.paged_attention", reason="this JAX has no Pallas GPU paged-attention kernel"
  )
  model, params = model_params()
  prompts = random_tokens((3, 10), seed=5)
  table = scattered_table(seed=1)
  logits = {}
  for impl in ("gather", "pallas_interpret"):
    _, cache = kvjax.extend(model, params, new_cache(model.config, table, paged_read=impl), prompts, LENGTHS)
    assert cache.paged_read == impl
    logits[impl], _ = kvjax.decode_step(model, params, cache, prompts[:, 0])
  np.testing.assert_allclose(logits["pallas_interpret"], logits["gather"], atol=1e-5)


def test_pool_size_follows_bytes_per_token():
  """A pool of P pages of Z tokens holds P x Z x (K and V of num_kv_heads x head_dim in the
  codec's dtype, per layer); rows() gives each row its own pages after the null page."""
  bf16 = CacheConfig(layout="paged", page_size=16, dtype="bfloat16")
  for num_kv_heads in (4, 2, 1):
    config = tiny_config(num_kv_heads)
    per_token = config.num_layers * 2 * num_kv_heads * config.head_dim * 2
    assert kinds.bytes_per_token(config, bf16) == per_token
    cache = kvjax.PagedCache.create(config, 9, 16, 2, 4, bf16)
    assert cache.nbytes == 9 * 16 * per_token
    assert (cache.num_pages, cache.page_size, cache.capacity) == (9, 16, 64)
    assert cache_layers(cache.layers)[0]["k"].dtype == np.dtype("uint16")  # bfloat16's bits
    rows = kvjax.PagedCache.rows(config, 2, 40, bf16)  # 3 pages per row
    np.testing.assert_array_equal(rows.page_table, [[1, 2, 3], [4, 5, 6]])
    assert rows.nbytes == 7 * 16 * per_token and rows.capacity == 48


def test_bad_input_is_rejected_before_compute():
  model, params = model_params()
  prompts = random_tokens((3, 10), seed=6)
  table = scattered_table(seed=2)
  holes = table.copy()
  holes[1, 0] = NULL_PAGE
  with pytest.raises(ValueError, match=r"row 1 has no page for positions \[0, 4\)"):
    kvjax.extend(model, params, new_cache(model.config, holes), prompts, LENGTHS)
  outside = table.copy()
  outside[2, 5] = NUM_PAGES
  with pytest.raises(ValueError, match=r"page_table\[2, 5\]=30 is outside"):
    kvjax.extend(model, params, new_cache(model.config, outside), prompts, LENGTHS)
  with pytest.raises(ValueError, match="needs 10 positions but the page table holds 2 pages"):
    kvjax.extend(model, params, new_cache(model.config, table[:, :2]), prompts, LENGTHS)
  full = new_cache(model.config, table, np.full(3, MAX_PAGES * PAGE_SIZE))
  with pytest.raises(ValueError, match="needs 33 positions"):
    kvjax.decode_step(model, params, full, np.zeros(3, np.int32))
  ready = new_cache(model.config, table, LENGTHS)
  with pytest.raises(ValueError, match="token id 64 at row 0"):
    kvjax.decode_step(model, params, ready, np.array([64, 0, 0]))
  with pytest.raises(ValueError, match="CacheConfig.paged_read must be one of"):
    new_cache(model.config, paged_read="flash")
  if not paged.pallas_available():
    with pytest.raises(ValueError, match="paged_read='pallas' needs a GPU backend .* the backend is 'cpu'"):
      new_cache(model.config, paged_read="pallas")
  with pytest.raises(ValueError, match="real pages"):
    ready.copy_pages([0], [3])
  with pytest.raises(ValueError, match="leaves no page besides the reserved null page"):
    kvjax.PagedCache.create(model.config, 1, PAGE_SIZE, 3, MAX_PAGES)
