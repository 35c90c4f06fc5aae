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
from kvjax.training import checkpoint
from kvjax.cli import main as cli
from kvjax.config import ModelConfig
from kvjax.fields import apply_overrides, to_dict
from kvjax.model.params import abstract_params
from kvjax.training.config import TrainConfig, TrainRun
from kvjax.conversion.conversions import KVHeads
from kvjax.conversion.uptrain import uptrain_config


def test_parse_mesh():
  assert sharding.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
  assert sharding.parse_mesh("model=8") == {"data": 1, "model": 8}
  for bad, message in (
    ("pipe=2", "AXIS=SIZE"),
    ("data=0", "positive integer"),
    ("model", "AXIS=SIZE"),
    ("data=two", "positive integer"),
  ):
    with pytest.raises(ValueError, match=message):
      sharding.parse_mesh(bad)
  with pytest.raises(ValueError, match=f"needs {4 * jax.device_count()} devices"):
    sharding.make_mesh(data=4, model=jax.device_count())


def test_without_a_mesh_host_params_are_placed_on_the_device_once():
  host = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
  placed, (batch,) = sharding.place(None, host, np.arange(2))
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(placed))
  np.testing.assert_array_equal(np.asarray(placed["w"]), host["w"])
  assert isinstance(batch, np.ndarray)  # a batch is the call's to place
  again, _ = sharding.place(None, placed)
  assert again is placed  # device params pass through untouched


def test_rules_cover_every_matrix_of_the_model():
  mesh = sharding.make_mesh(1, 1)
  config = ModelConfig(
    vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, qkv_bias=True, use_bias=True
  )
  specs = jax.tree.map(lambda s: tuple(s.spec), sharding.param_sharding(abstract_params(config), mesh))
  attn, mlp = specs["layers_0"]["attn"], specs["layers_0"]["mlp"]
  assert attn["q"]["kernel"] == attn["k"]["kernel"] == (None, "model", None)
  assert attn["out"]["kernel"] == ("model", None, None) and attn["out"]["bias"] == ()
  assert mlp["up"]["kernel"] == (None, "model") and mlp["down"]["kernel"] == ("model", None)
  assert specs["embed"]["embedding"] == ("model", None) and specs["lm_head"]["kernel"] == (None, "model")
  assert specs["final_norm"]["scale"] == ()


def test_cache_rules_split_rows_and_heads_never_the_sequence():
  """Each cache kind's partition rule (KVCache.partition_rule), as cache_sharding places it:
  contiguous arrays [B, heads, ...] rows on data, heads on model; page pools [heads, P, Z, ...]
  heads on model; lengths and page table rows on data; no axis after the heads (sequence, slots,
  pages, widths, scale groups) is ever split, for K/V and MLA's latents, float or int4."""
  from kvjax.cache import kinds
  from kvjax.cache.config import CacheConfig

  mesh = sharding.make_mesh(1, 1)
  for config in (
    ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=16),
    ModelConfig(
      vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=16, kv_latent_rank=8, rope_dims=4
    ),
  ):
    for cache_config in (
      CacheConfig(),
      CacheConfig(dtype="int4"),
      CacheConfig(layout="paged", page_size=4),
      CacheConfig(layout="paged", page_size=4, dtype="int4"),
    ):
      cache = kinds.create(config, cache_config, 2, 8)
      specs = jax.tree.map(lambda s: tuple(s.spec), sharding.cache_sharding(cache, mesh))
      lead = ("data", "model") if cache_config.layout == "contiguous" else ("model",)
      for name, got in specs.layers["layers_0"]["attn"].items():
        assert got == lead + (None,) * (cache.layers["layers_0"]["attn"][name].ndim - len(lead)), (cache_config, name)
      assert specs.lengths == ("data",)
      if cache_config.layout == "paged":
        assert specs.page_table == ("data", None)


def test_place_without_mesh_is_identity_and_batch_must_split():
  params, tokens = {"w": jax.numpy.ones(3)}, np.zeros((3, 2), np.int32)  # device params (host ones: below)
  placed, batch = sharding.place(None, params, tokens)
  assert placed is params and batch[0] is tokens
  assert not sharding.initialize_distributed() or "JAX_COORDINATOR_ADDRESS" in os.environ
  if jax.device_count() == 1:
    mesh = sharding.make_mesh(1, 1)
    (placed,) = sharding.shard_batch(mesh, tokens)
    np.testing.assert_array_equal(placed, tokens)


def test_train_mesh_is_validated_resumable_and_not_inherited_by_uptraining():
  assert TrainConfig(mesh="data=2,model=4", batch_size=8).mesh == "data=2,model=4"
  for mesh, message in (
    ("pipe=2", r"TrainConfig.mesh='pipe=2': mesh item"),
    ("", "TrainConfig.mesh must be"),
    (4, "TrainConfig.mesh must be"),
    ("data=0", "TrainConfig.mesh='data=0'.*positive"),
  ):
    with pytest.raises(ValueError, match=message):
      TrainConfig(mesh=mesh)
  with pytest.raises(ValueError, match=r"TrainConfig.batch_size=6 does not split over the data axis"):
    TrainConfig(mesh="data=4", batch_size=6)
  run = apply_overrides(TrainRun(), ["train.mesh=data=2,model=4"])
  assert run.train.mesh == "data=2,model=4"
  checkpoint.check_compatible(to_dict(TrainRun()), to_dict(run), "workdir")  # another mesh resumes
  with pytest.raises(ValueError, match="train.batch_size"):
    checkpoint.check_compatible(to_dict(TrainRun()), to_dict(apply_overrides(run, ["train.batch_size=8"])), "w")
  source = to_dict(run)
  assert uptrain_config(source, 100, KVHeads(2), 0.1).train.mesh is None
  assert uptrain_config(source, 100, KVHeads(2), 0.1, ["train.mesh=model=2"]).train.mesh == "model=2"


def test_mesh_options_on_run_eval_generate_uptrain(tmp_path, capsys):
  parser = cli.build_parser()
  commands = {
    "run": ["c.py"],
    "eval": ["--workdir", "w"],
    "generate": ["--workdir", "w", "--prompt", "p"],
    "uptrain": ["--from", "a", "--workdir", "b", "--kv-heads", "1"],
  }
  for name, required in commands.items():
    assert parser.parse_args([name, *required, "--mesh", "data=2,model=4"]).mesh == "data=2,model=4"
    assert parser.parse_args([name, *required]).mesh is None
    # One parser for the text everywhere: a malformed mesh stops the command line, naming the item.
    with pytest.raises(SystemExit) as exit_info:
      parser.parse_args([name, *required, "--mesh", "pipe=2"])
    assert exit_info.value.code == 2
    assert f"kvjax {name}: error: argument --mesh: mesh item 'pipe=2'" in capsys.readouterr().err
  # A mesh larger than this machine stops `kvjax run` before any work, naming the devices.
  workdir = tmp_path / "run"
  tiny = str(Path(__file__).resolve().parent.parent / "configs" / "train" / "tiny.py")
  assert cli.main(["run", tiny, "--workdir", str(workdir), "--mesh", f"data={jax.device_count()},model=2"]) == 2
  assert f"needs {2 * jax.device_count()} devices" in capsys.readouterr().err
  assert not workdir.exists()  # refused before the workdir is claimed
  # --mesh is for configs with a train section.
  config = tmp_path / "no_train.py"
  config.write_text(
    "import dataclasses\n\n@dataclasses.dataclass(frozen=True)\nclass Job:\n  job: str = 'x'\n\n"
    "def get_config():\n  return Job()\n"
  )
  assert cli.main(["run", str(config), "--workdir", str(tmp_path / "x"), "--mesh", "model=2"]) == 2
  assert "has no train.mesh" in capsys.readouterr().err


@pytest.mark.parametrize(
  "cases, count",
  [
    ("not train_step and not kvjax_run", 7),  # prefill, decode, generate, codecs, MLA, the kv gather
    pytest.param("train_step or kvjax_run", 2, marks=pytest.mark.tier2),  # training and a whole run
  ],
  ids=["decoding", "training"],
)
def test_sharded_runs_match_one_device_on_8_cpu_devices(tmp_path, cases, count):
  # LLVM's cheapest level halves the compile times that dominate these tiny runs; the cache lets
  # the resumed training runs reuse the steps compiled for the whole ones.
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
  )
  root = Path(__file__).resolve().parent.parent
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", cases, str(root / "tests" / "sharded_cases.py")],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert f"{count} passed" in proc.stdout
