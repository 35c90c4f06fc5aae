"""ModelConfig validation: every bad field is named with its value."""

from __future__ import annotations

import pytest

from kvjax import ModelConfig


def test_defaults_are_derived():
  cfg = ModelConfig(d_model=96, num_heads=6, num_kv_heads=2)
  assert (cfg.head_dim, cfg.q_per_kv, cfg.mlp_dim, cfg.cache_dtype) == (16, 3, 256, "float32")
  assert ModelConfig(d_model=64, activation="gelu").mlp_dim == 256
  assert cfg.kv_bytes_per_token == 2 * cfg.num_layers * 2 * 16 * 4


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=8, num_kv_heads=3), "num_heads=8 is not divisible by num_kv_heads=3"),
    (dict(num_kv_heads=0), "num_kv_heads must be a positive integer, got 0"),
    (dict(d_model=-4), "d_model must be a positive integer, got -4"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer, got 2.5"),
    (dict(activation="relu"), "activation must be one of .* got 'relu'"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(positions="alibi"), "positions must be one of"),
    (dict(dtype="float8"), "dtype must be one of"),
    (dict(cache_dtype="int4"), "cache_dtype must be one of"),
    (dict(d_model=100, num_heads=3), "d_model=100 is not divisible by num_heads=3"),
    (dict(head_dim=7, d_model=28, num_heads=4), "head_dim=7 must be even for RoPE"),
    (dict(max_len=0), "max_len must be a positive integer"),
])
def test_invalid_values_name_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(**kwargs)
