"""abstract_params against a real init, and check_params' report of what differs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.model.params import abstract_params, check_params, param_signature
from kvjax.model.transformer import Transformer

CONFIGS = {
  "gqa": ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64),
  "gpt2": ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=4,
    activation="gelu",
    norm="layernorm",
    positions="learned",
    qkv_bias=True,
    use_bias=True,
    tie_embeddings=True,
    max_len=16,
    dtype="bfloat16",
  ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_abstract_params_are_the_shapes_init_builds(name):
  config = CONFIGS[name]
  params = Transformer(config).init(jax.random.key(1), jnp.zeros((2, 3), jnp.int32))["params"]
  shapes = abstract_params(config)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
  assert param_signature(shapes) == param_signature(params)
  check_params(params, config)


def test_check_params_names_the_differing_parameters():
  config = CONFIGS["gqa"]
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config))
  params["layers_1"]["attn"]["k"]["kernel"] = np.zeros((32, 4, 8), np.float32)  # MHA's kv heads
  del params["final_norm"]
  with pytest.raises(
    ValueError,
    match=r"imported do not match the model config: final_norm/scale: "
    r"expected \(\(32,\), 'float32'\), got None; layers_1/attn/k/kernel",
  ):
    check_params(params, config, "imported")
