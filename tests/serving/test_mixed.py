"""A mixed call (kvjax.serving.mixed): decode rows and a context's chunk packed in one call give
each row what a call of its own gives, the logits of a decode step and of an extension, and leave
the pools as those two calls leave them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import KNorm
from kvjax.decoding.decode import for_decoding
from kvjax.serving import mixed, steps
from conftest import init_params, tiered, tiny_config

PAGE = 4
MAX_PAGES = 8
NUM_PAGES = 1 + 4 * MAX_PAGES
# Rows: two decoding (contexts of 9 and 14 tokens), one idle between them, then the chunk's row,
# which already holds 6 tokens and takes 7 more (padded to 16 columns).
HELD = (9, 0, 14)
CHUNK_HELD, CHUNK = 6, 7

CASES = {
  "gqa": (tiny_config(2), "float32"),
  "windowed": (tiny_config(2, window=(8, 0)), "float32"),  # a windowed layer's rows read by gather
  "int8": (tiny_config(1), "int8"),
  "mla": (tiny_config(2, kv_latent_rank=12, rope_dims=8), "float32"),
}


def table() -> np.ndarray:
  """Each row's pages scattered over the pool; the idle row all null pages."""
  pages = np.random.default_rng(0).permutation(np.arange(1, NUM_PAGES)).reshape(4, MAX_PAGES)
  pages[1] = 0
  return pages.astype(np.int32)


def filled(model, params, cache, rng):
  """The pools holding each row's context (HELD, then the chunk row's CHUNK_HELD tokens), and
  each decoding row's next token."""
  pages = table()
  for row, held in enumerate(HELD + (CHUNK_HELD,)):
    if held:
      tokens = np.zeros((1, 16), np.int32)
      tokens[0, :held] = rng.integers(0, 64, held)
      _, cache = steps.prefill(model, params, cache.with_rows(pages[row : row + 1], [0]), tokens, np.array([held]))
  return cache, rng.integers(0, 64, len(HELD)).astype(np.int32)


@pytest.mark.parametrize("case", tiered(list(CASES), ("windowed", "int8")))
def test_a_mixed_call_equals_its_rows_own_calls(case):
  config, dtype = CASES[case]
  model, params = init_params(config)
  model = for_decoding(model)
  cache_config = CacheConfig(layout="paged", page_size=PAGE, dtype=dtype)
  empty = kinds.kind(cache_config).create(config, NUM_PAGES, PAGE, 1, MAX_PAGES, cache_config)
  rng = np.random.default_rng(1)
  cache, tokens = filled(model, params, empty, rng)
  chunk = np.zeros((1, 16), np.int32)
  chunk[0, :CHUNK] = rng.integers(0, 64, CHUNK)
  copy = lambda c: jax.tree.map(jnp.copy, c)  # noqa: E731 (the calls donate their cache)
  pages = table()

  decoded, alone = steps.decode(model, params, copy(cache).with_rows(pages[:3], HELD), jnp.asarray(tokens))
  extended, alone = steps.extend(
    model, params, alone.with_rows(pages[3:], [CHUNK_HELD]), jnp.asarray(chunk), jnp.array([CHUNK])
  )
  logits, together = mixed.step(
    model, params, copy(cache).with_rows(pages, HELD + (CHUNK_HELD,)), tokens, chunk, np.array([CHUNK])
  )

  live = [0, 2]  # the idle row's logits are never read
  np.testing.assert_allclose(logits[np.array(live)], decoded[np.array(live)], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(logits[3], extended[0], atol=2e-5, rtol=1e-5)
  assert np.array_equal(np.argmax(logits[3]), np.argmax(extended[0]))
  for want, got in zip(jax.tree.leaves(alone.layers), jax.tree.leaves(together.layers)):
    # Page 0 is the null page: what padding and idle rows write there is never read.
    np.testing.assert_allclose(np.asarray(got)[:, 1:], np.asarray(want)[:, 1:], atol=2e-5, rtol=1e-5)


def test_a_mixed_call_over_another_layout_is_refused_by_name():
  """The mixed call writes, then reads, as the paged layout's attend does; a pressed layout's attend
  is its own, so it is refused, naming the layout."""
  config = tiny_config(2)
  model, params = init_params(config)
  cache_config = CacheConfig(layout="paged_evict", page_size=PAGE, press=KNorm(compression_ratio=0.5))
  pressed = kinds.kind(cache_config).create(config, NUM_PAGES, PAGE, 2, MAX_PAGES, cache_config)
  with pytest.raises(ValueError, match="paged_evict"):
    mixed.step(model, params, pressed, np.zeros(1, np.int32), np.zeros((1, 16), np.int32), np.array([1]))
