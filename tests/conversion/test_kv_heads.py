"""MHA -> GQA / MQA conversion: exact where it must be, contiguous groups, clear errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.conversion.conversions import KVHeads
from conftest import init_params, tiny_config

TOKENS = np.asarray(jax.random.randint(jax.random.key(7), (2, 12), 0, 64))


def logits(config, params):
  return np.asarray(kvjax.Transformer(config).apply({"params": params}, TOKENS))


def tie_heads(params, config, blocks):
  """Copies, in every layer's K and V (kernel and bias), the first head of each block to the rest."""
  params = jax.tree.map(np.array, params)
  for i in range(config.num_layers):
    for proj in ("k", "v"):
      for leaf, value in params[f"layers_{i}"]["attn"][proj].items():
        axis = value.ndim - 2
        for block in blocks:
          src = np.take(value, [block[0]], axis=axis)
          for head in block[1:]:
            idx = [slice(None)] * value.ndim
            idx[axis] = head
            value[tuple(idx)] = np.squeeze(src, axis)
  return params


@pytest.fixture
def mha():
  config = tiny_config(4, qkv_bias=True)  # 4 query heads, 4 kv heads
  return config, init_params(config)[1]


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("target,blocks", [(2, [(0, 1), (2, 3)]), (1, [(0, 1, 2, 3)])])
def test_equal_heads_within_groups_convert_exactly(mha, method, target, blocks):
  config, params = mha
  tied = tie_heads(params, config, blocks)
  new_params, new_config = KVHeads(target, method).convert(tied, config)
  assert new_config == KVHeads(target, method).target(config) and new_config.num_kv_heads == target
  assert new_params["layers_0"]["attn"]["k"]["kernel"].shape == (32, target, 8)
  np.testing.assert_allclose(logits(new_config, new_params), logits(config, tied), atol=1e-5)


def test_strided_grouping_would_change_the_logits(mha):
  """Heads tied in contiguous pairs: pooling (0, 1), (2, 3) is exact, pooling (0, 2), (1, 3) is not."""
  config, params = mha
  tied = tie_heads(params, config, [(0, 1), (2, 3)])
  new_params, new_config = kvjax.convert_kv_heads(tied, config, 2, "mean")
  strided = jax.tree.map(np.array, new_params)
  for i in range(config.num_layers):
    for proj in ("k", "v"):
      for leaf, value in tied[f"layers_{i}"]["attn"][proj].items():
        axis = value.ndim - 2
        pooled = (np.take(value, [0, 1], axis) + np.take(value, [2, 3], axis)) / 2
        strided[f"layers_{i}"]["attn"][proj][leaf] = pooled
  reference = logits(config, tied)
  np.testing.assert_allclose(logits(new_config, new_params), reference, atol=1e-5)
  assert np.abs(logits(new_config, strided) - reference).max() > 1e-2


def test_mean_pools_contiguous_blocks(mha):
  config, params = mha
  new_params, _ = kvjax.convert_kv_heads(params, config, 2, "mean")
  old = np.asarray(params["layers_1"]["attn"]["v"]["kernel"])
  new = np.asarray(new_params["layers_1"]["attn"]["v"]["kernel"])
  np.testing.assert_allclose(new[:, 1], (old[:, 2] + old[:, 3]) / 2, atol=1e-7)
  old_bias = np.asarray(params["layers_1"]["attn"]["k"]["bias"])
  np.testing.assert_allclose(new_params["layers_1"]["attn"]["k"]["bias"][0], old_bias[:2].mean(0), atol=1e-7)
  # Queries, output projection and MLP are untouched.
  assert new_params["layers_1"]["attn"]["q"] is params["layers_1"]["attn"]["q"]
  assert new_params["layers_1"]["mlp"] is params["layers_1"]["mlp"]


def test_gqa_to_mqa_and_identity():
  config, params = tiny_config(2), init_params(tiny_config(2))[1]
  same, same_config = kvjax.convert_kv_heads(params, config, 2)
  np.testing.assert_array_equal(logits(same_config, same), logits(config, params))
  tied = tie_heads(params, config, [(0, 1)])
  mqa, mqa_config = kvjax.convert_kv_heads(tied, config, 1, "mean")
  np.testing.assert_allclose(logits(mqa_config, mqa), logits(config, tied), atol=1e-5)


def test_random_reinitialises_kv_only(mha):
  config, params = mha
  new_params, _ = kvjax.convert_kv_heads(params, config, 2, "random", rng=jax.random.key(3))
  kernel = np.asarray(new_params["layers_0"]["attn"]["k"]["kernel"])
  assert kernel.shape == (32, 2, 8) and abs(kernel.std() - 32**-0.5) < 0.03
  assert not np.allclose(kernel, kvjax.convert_kv_heads(params, config, 2)[0]["layers_0"]["attn"]["k"]["kernel"])
  np.testing.assert_array_equal(new_params["layers_0"]["attn"]["k"]["bias"], 0)


@pytest.mark.parametrize(
  "target,method,kwargs,match",
  [
    (3, "mean", {}, "cannot convert 4 kv heads to 3"),
    (8, "mean", {}, "cannot convert 4 kv heads to 8"),
    (0, "mean", {}, "positive integer"),
    (2, "median", {}, "method must be one of"),
    (2, "random", {}, "needs an rng"),
  ],
)
def test_errors(mha, target, method, kwargs, match):
  config, params = mha
  with pytest.raises(ValueError, match=match):
    kvjax.convert_kv_heads(params, config, target, method, **kwargs)
