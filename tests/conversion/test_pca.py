"""The pca conversion: exact on heads that are RoPE-commuting (or, for learned positions, linear)
transforms of one another, where mean-pooling is not; identity; clear errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.conversion.conversions import KVHeads
from conftest import init_params, tiny_config

TOKENS = np.asarray(jax.random.randint(jax.random.key(7), (2, 12), 0, 64))
CALIBRATION = np.asarray(jax.random.randint(jax.random.key(8), (4, 32), 0, 64))


def logits(config, params):
  return np.asarray(kvjax.Transformer(config).apply({"params": params}, TOKENS))


def transformed_heads(params, config, group: int, seed: int = 0):
  """Within each group of `group` kv heads, every head's K is its group's first head times a random
  complex number per RoPE pair (or, with learned positions, a random matrix), and its V the first
  head's V times a random invertible matrix: the structure the pca conversion recovers exactly."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(np.array, params)
  h = config.head_dim
  for i in range(config.num_layers):
    attn = params[f"layers_{i}"]["attn"]
    for first in range(0, config.num_kv_heads, group):
      for head in range(first + 1, first + group):
        if config.positions == "rope":
          rotate = rng.normal(size=h // 2) + 1j * rng.normal(size=h // 2)

          def k_map(a):
            z = (a[..., : h // 2] + 1j * a[..., h // 2 :]) * rotate
            return np.concatenate([z.real, z.imag], axis=-1)
        else:
          matrix = rng.normal(size=(h, h)) + 2 * np.eye(h)
          k_map = lambda a: a @ matrix
        mix = rng.normal(size=(h, h)) + 2 * np.eye(h)
        for leaf, value in attn["k"].items():
          idx = (slice(None),) * (value.ndim - 2)
          value[idx + (head,)] = k_map(value[idx + (first,)])
        for leaf, value in attn["v"].items():
          idx = (slice(None),) * (value.ndim - 2)
          value[idx + (head,)] = value[idx + (first,)] @ mix
  return params


@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.parametrize("target", [2, 1])
def test_pca_is_exact_where_mean_pooling_is_not(positions, target):
  config = tiny_config(4, qkv_bias=True, positions=positions)
  params = transformed_heads(init_params(config)[1], config, 4 // target)
  want = logits(config, params)
  pca_params, pca_config = KVHeads(target, "pca").convert(params, config, CALIBRATION)
  assert pca_config.num_kv_heads == target
  assert pca_params["layers_0"]["attn"]["k"]["kernel"].dtype == params["layers_0"]["attn"]["k"]["kernel"].dtype
  np.testing.assert_allclose(logits(pca_config, pca_params), want, atol=2e-4, rtol=1e-4)
  mean_params, mean_config = kvjax.convert_kv_heads(params, config, target, "mean")
  assert np.abs(logits(mean_config, mean_params) - want).max() > 0.1


def test_pca_from_gqa_to_mqa_and_identity():
  config = tiny_config(2)
  params = transformed_heads(init_params(config)[1], config, 2)
  same, same_config = kvjax.convert_kv_heads(params, config, 2, "pca", calibration=CALIBRATION)
  assert same is params and same_config == config
  mqa, mqa_config = kvjax.convert_kv_heads(params, config, 1, "pca", calibration=CALIBRATION)
  np.testing.assert_allclose(logits(mqa_config, mqa), logits(config, params), atol=2e-4, rtol=1e-4)


def test_pca_beats_mean_pooling_on_an_untied_model():
  """On random heads neither is exact; pca's logits stay closer to the source's."""
  config = tiny_config(4)
  params = init_params(config)[1]
  want = logits(config, params)
  errors = {}
  for method in ("mean", "pca"):
    new, new_config = kvjax.convert_kv_heads(params, config, 1, method, calibration=CALIBRATION)
    errors[method] = np.abs(logits(new_config, new) - want).mean()
  assert errors["pca"] < errors["mean"]


def test_pca_errors():
  config = tiny_config(4)
  params = init_params(config)[1]
  with pytest.raises(ValueError, match="needs calibration tokens"):
    kvjax.convert_kv_heads(params, config, 2, "pca")
  with pytest.raises(ValueError, match="calibration token id 64 at row 0, position 1"):
    kvjax.convert_kv_heads(params, config, 2, "pca", calibration=np.array([[1, 64, 2]]))
  with pytest.raises(ValueError, match="integer array"):
    kvjax.convert_kv_heads(params, config, 2, "pca", calibration=np.ones((2, 3)))
  with pytest.raises(ValueError, match="method must be one of"):
    kvjax.convert_kv_heads(params, config, 2, "svd")


def test_permuting_heads_keeps_the_function():
  from kvjax.conversion import pca

  config = tiny_config(2, qkv_bias=True, use_bias=True)
  params = jax.tree.map(np.asarray, init_params(config)[1])
  permuted = dict(params)
  for i in range(config.num_layers):
    permuted[f"layers_{i}"] = {
      **params[f"layers_{i}"],
      "attn": pca.permute_heads(params[f"layers_{i}"]["attn"], config, np.array([1, 0])),
    }
  assert not np.array_equal(permuted["layers_0"]["attn"]["k"]["kernel"], params["layers_0"]["attn"]["k"]["kernel"])
  np.testing.assert_allclose(logits(config, permuted), logits(config, params), atol=1e-5)


def test_regroup_finds_strided_partners_that_index_order_splits():
  """Heads 0 and 2 (and 1 and 3) are transforms of one another: grouping by index, (0, 1) and
  (2, 3), loses information; regroup pairs them as (0, 2), (1, 3) and converts exactly."""
  config = tiny_config(4)
  params = jax.tree.map(np.array, init_params(config)[1])
  order = [0, 2, 1, 3]
  contiguous = transformed_heads(params, config, 2)
  strided = dict(contiguous)
  from kvjax.conversion import pca

  for i in range(config.num_layers):  # the tied pairs moved apart: new head order[j] = old head j
    strided[f"layers_{i}"] = {
      **contiguous[f"layers_{i}"],
      "attn": pca.permute_heads(contiguous[f"layers_{i}"]["attn"], config, np.argsort(order)),
    }
  want = logits(config, strided)
  regrouped, new_config = KVHeads(2, "regroup").convert(strided, config, CALIBRATION)
  np.testing.assert_allclose(logits(new_config, regrouped), want, atol=2e-4, rtol=1e-4)
  plain, _ = kvjax.convert_kv_heads(strided, config, 2, "pca", calibration=CALIBRATION)
  assert np.abs(logits(new_config, plain) - want).max() > 0.05
