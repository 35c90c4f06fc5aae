"""Shared fixtures: tiny MHA / GQA / MQA models with random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kvjax

VARIANTS = {"mha": 4, "gqa": 2, "mqa": 1}


def tiny_config(num_kv_heads: int = 2, **changes) -> kvjax.ModelConfig:
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads,
              mlp_dim=64, max_len=64)
  return kvjax.ModelConfig(**{**base, **changes})


def init_params(config: kvjax.ModelConfig, seed: int = 0):
  model = kvjax.Transformer(config)
  params = model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
  return model, params


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant(request):
  """(name, model, params) for each attention variant."""
  model, params = init_params(tiny_config(VARIANTS[request.param]))
  return request.param, model, params
