"""Sharding rules and mesh parsing here; sharded == single-device runs on 8 host CPU devices in
a child process (tests/sharded_cases.py), since the device count is fixed when JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax import sharding
from kvjax.config import ModelConfig
from kvjax.hf import param_shapes


def test_parse_mesh():
  assert sharding.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
  assert sharding.parse_mesh("model=8") == {"data": 1, "model": 8}
  for bad, message in (("pipe=2", "AXIS=SIZE"), ("data=0", "positive integer"), ("model", "AXIS=SIZE"),
                       ("data=two", "positive integer")):
    with pytest.raises(ValueError, match=message):
      sharding.parse_mesh(bad)
  with pytest.raises(ValueError, match=f"needs {4 * jax.device_count()} devices"):
    sharding.make_mesh(data=4, model=jax.device_count())


def test_rules_cover_every_matrix_of_the_model():
  mesh = sharding.make_mesh(1, 1)
  config = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                       qkv_bias=True, use_bias=True)
  specs = jax.tree.map(lambda s: tuple(s.spec), sharding.param_sharding(param_shapes(config), mesh))
  attn, mlp = specs["layers_0"]["attn"], specs["layers_0"]["mlp"]
  assert attn["q"]["kernel"] == attn["k"]["kernel"] == (None, "model", None)
  assert attn["out"]["kernel"] == ("model", None, None) and attn["out"]["bias"] == ()
  assert mlp["up"]["kernel"] == (None, "model") and mlp["down"]["kernel"] == ("model", None)
  assert specs["embed"]["embedding"] == ("model", None) and specs["lm_head"]["kernel"] == (None, "model")
  assert specs["final_norm"]["scale"] == ()


def test_place_without_mesh_is_identity_and_batch_must_split():
  params, tokens = {"w": np.ones(3)}, np.zeros((3, 2), np.int32)
  assert sharding.place(None, params, tokens) == (params, (tokens,))
  assert not sharding.initialize_distributed() or "JAX_COORDINATOR_ADDRESS" in os.environ
  if jax.device_count() == 1:
    mesh = sharding.make_mesh(1, 1)
    (placed,) = sharding.shard_batch(mesh, tokens)
    np.testing.assert_array_equal(placed, tokens)


def test_sharded_runs_match_one_device_on_8_cpu_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  root = Path(__file__).resolve().parent.parent
  proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                         str(root / "tests" / "sharded_cases.py")],
                        cwd=root, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert "4 passed" in proc.stdout
