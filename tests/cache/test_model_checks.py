"""A cache must fit the model it is decoded with: refused before compute otherwise."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvjax
from kvjax.cache.config import CacheConfig
from conftest import init_params, tiny_config


def contiguous(config, **changes):
  return kvjax.ContiguousCache.create(config.replace(**changes), 2, 16)


def paged(config, **changes):
  cache = kvjax.PagedCache.create(config.replace(**changes), 9, 4, 2, 4, CacheConfig(layout="paged", page_size=4))
  return cache.with_rows(np.arange(1, 9).reshape(2, 4), np.zeros(2, np.int32))


def as_bfloat16(cache):
  """The cache with its arrays cast to bfloat16 behind its float32 codec's back."""
  return cache.replace(layers=jax.tree.map(lambda x: x.astype(jnp.bfloat16), cache.layers))


@pytest.mark.parametrize("make", [contiguous, paged], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
  "changes, message",
  [
    (
      dict(num_kv_heads=2),
      r"it stores \['k', 'v'\] per token \(\{'k': Field\(heads=2, width=8.*\), "
      r"the model's attention hands it \{'k': Field\(heads=1, width=8",
    ),
    (dict(num_kv_heads=1, head_dim=16), r"Field\(heads=1, width=16.* hands it \{'k': Field\(heads=1, width=8,"),
    (dict(num_kv_heads=1, num_layers=3), r"has 3 layers but the model has num_layers=2"),
    (
      dict(num_kv_heads=1, kv_latent_rank=8, rope_dims=2),
      r"it stores \['latent', 'rope_key'\] per token .* the model's attention hands it \{'k'",
    ),
    ("bfloat16 arrays", r"layer 0 k is \(.*bfloat16.*\), but .* in a float32 cache needs \(.*float32"),
  ],
)
def test_a_cache_of_another_model_is_refused(make, changes, message):
  model, params = init_params(tiny_config(1))
  cache = as_bfloat16(make(model.config)) if changes == "bfloat16 arrays" else make(model.config, **changes)
  with pytest.raises(ValueError, match=message):
    kvjax.decode_step(model, params, cache, np.zeros(2, np.int32))
  with pytest.raises(ValueError, match=message):
    kvjax.extend(model, params, cache, np.zeros((2, 3), np.int32), np.array([3, 1]))


def test_what_is_not_a_cache_and_rows_past_max_len_are_refused():
  model, params = init_params(tiny_config(1, max_len=14))
  with pytest.raises(ValueError, match="cache must be a kvjax cache .* got dict"):
    kvjax.decode_step(model, params, {"lengths": np.zeros(2, np.int32)}, np.zeros(2, np.int32))
  cache = kvjax.PagedCache.create(model.config, 9, 4, 2, 4).with_rows(np.arange(1, 9).reshape(2, 4), [13, 2])
  with pytest.raises(ValueError, match="row 0 would hold 15 tokens, more than ModelConfig.max_len=14"):
    kvjax.extend(model, params, cache, np.zeros((2, 2), np.int32), np.array([2, 2]))


def test_a_cache_larger_than_memory_is_refused_before_allocating():
  config = tiny_config(1)
  with pytest.raises(ValueError, match="a contiguous cache of 100000000 rows x 64 positions needs about"):
    kvjax.ContiguousCache.create(config, 10**8, 64)
  with pytest.raises(ValueError, match="a paged cache of 100000000 pages x 64 tokens needs about"):
    kvjax.PagedCache.create(config, 10**8, 64, 2, 1)
