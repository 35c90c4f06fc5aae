"""convert_to_mla: exact where the source has the structure MLA keeps (every frequency kept at
full rank; a few frequencies and a low-rank K/V on a model built so), smooth below; clear errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.conversion.conversions import ToMLA
from kvjax.conversion.mla import convert_to_mla
from conftest import init_params, tiny_config

TOKENS = np.asarray(jax.random.randint(jax.random.key(7), (2, 24), 0, 64))  # held out
CALIBRATION = np.asarray(jax.random.randint(jax.random.key(8), (8, 32), 0, 64))


def logits(config, params):
  return np.asarray(kvjax.Transformer(config).apply({"params": params}, TOKENS))


@pytest.mark.parametrize(
  "num_kv_heads, changes",
  [(2, {}), (4, {"qkv_bias": True}), (2, {"positions": "learned"})],
  ids=["gqa", "mha-bias", "learned"],
)
def test_full_rank_every_frequency_kept_is_exact(num_kv_heads, changes):
  """Every frequency kept and the rank of the stacked K/V projections: the source's logits, and a
  cache that holds as many bytes per token as the source's."""
  config = tiny_config(num_kv_heads, **changes)
  _, params = init_params(config)
  h = config.head_dim
  rope_dims = 0 if config.positions == "learned" else num_kv_heads * h
  rank = min(config.d_model, num_kv_heads * (2 * h - rope_dims // num_kv_heads))
  new_params, new_config = ToMLA(rank, rope_dims).convert(params, config, CALIBRATION)
  assert new_config.is_latent and new_config.kv_latent_rank == rank
  assert kinds.bytes_per_token(new_config) <= kinds.bytes_per_token(config)
  np.testing.assert_allclose(logits(new_config, new_params), logits(config, params), atol=2e-5)


def structured(params, config, kept: dict[int, list[int]], rank: int, seed: int = 0):
  """Query heads of kv head j see keys only through the frequency pairs kept[j] (their queries are
  0 elsewhere), and the K and V projections of each layer jointly have rank `rank`: the partial
  RoPE and low-rank structure convert_to_mla keeps exactly."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(np.array, params)
  d, k, h, g = config.d_model, config.num_kv_heads, config.head_dim, config.q_per_kv
  for i in range(config.num_layers):
    attn = params[f"layers_{i}"]["attn"]
    for j, pairs in kept.items():
      dropped = np.setdiff1d(np.arange(h // 2), pairs)
      attn["q"]["kernel"][:, j * g : (j + 1) * g][..., np.concatenate([dropped, dropped + h // 2])] = 0
    joint = (rng.normal(size=(d, rank)) @ rng.normal(size=(rank, 2 * k * h))) * d**-0.5 / rank**0.5
    attn["k"]["kernel"][:] = joint[:, : k * h].reshape(d, k, h)
    attn["v"]["kernel"][:] = joint[:, k * h :].reshape(d, k, h)
  return params


def test_partial_rope_low_rank_model_is_exact():
  """On a model built with that structure, keeping 2 of 4 pairs per kv head and rank 6 of 32 gives
  the source's logits: the pair scores find the pairs the queries use, the factorisation the rank."""
  config = tiny_config(2)
  _, params = init_params(config)
  kept = {0: [1, 3], 1: [0, 2]}
  params = structured(params, config, kept, rank=6)
  new_params, new_config = convert_to_mla(params, config, 6, 8, calibration=CALIBRATION)
  assert new_config.rope_pairs == ((1, 3, 0, 2),) * 2
  assert kinds.bytes_per_token(new_config) == 2 * (6 + 8) * 4
  np.testing.assert_allclose(logits(new_config, new_params), logits(config, params), atol=2e-5)


def test_lower_rank_degrades_smoothly():
  """Held-out KL to the source grows as the rank falls, from 0 at full rank."""
  config = tiny_config(2)
  _, params = init_params(config)
  source = jax.nn.log_softmax(logits(config, params))
  kl = {}
  for rank in (16, 12, 8, 4):
    new_params, new_config = convert_to_mla(params, config, rank, 16, calibration=CALIBRATION)
    converted = jax.nn.log_softmax(logits(new_config, new_params))
    kl[rank] = float((np.exp(source) * (source - converted)).sum(-1).mean())
  print("held-out KL(source || converted) by rank:", kl)
  assert kl[16] < 1e-8
  assert kl[16] < kl[12] <= kl[8] <= kl[4]


def test_errors():
  config = tiny_config(2)
  _, params = init_params(config)
  convert = lambda cfg=config, rank=8, rope_dims=8, calibration=CALIBRATION: convert_to_mla(
    params, cfg, rank, rope_dims, calibration=calibration
  )
  with pytest.raises(ValueError, match="kv_latent_rank=33 is larger than possible"):
    convert(rank=33)
  with pytest.raises(ValueError, match="more than head_dim=8"):
    convert(rope_dims=20)
  with pytest.raises(ValueError, match="multiple of 2 x num_kv_heads"):
    convert(rope_dims=6)
  with pytest.raises(ValueError, match="positions='learned', which has none"):
    convert(tiny_config(2, positions="learned"))
  with pytest.raises(ValueError, match="calibration token id 64 at row 0, position 3"):
    convert(calibration=np.where(np.arange(32) == 3, 64, CALIBRATION))
  with pytest.raises(ValueError, match="needs calibration tokens"):
    convert(calibration=None)
  with pytest.raises(ValueError, match="already MLA"):
    convert(tiny_config(2, kv_latent_rank=8, rope_dims=8))
