"""Layer-local recovery (kvjax.conversion.local): each converted layer's attention learns the source
layer's output; exact when nothing changed, resumable to the same params, and `kvjax uptrain
--recovery local` end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax.cli.main import main
from kvjax.conversion import local
from kvjax.conversion.conversions import KVHeads
from kvjax.conversion.uptrain import uptrain
from kvjax.training import checkpoint
from kvjax.training.config import TrainConfig
from conftest import init_params, tiny_config

TRAIN = TrainConfig(steps=30, batch_size=4, lr=3e-3, warmup_steps=2)


@pytest.fixture(scope="module")
def converted():
  """A tiny MHA model with random weights, mean-pooled to MQA; calibration tokens."""
  model, params = init_params(tiny_config(4), seed=3)
  new_params, new_config = KVHeads(1, "mean").convert(params, model.config)
  tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (16, 24)).astype(np.int32)
  return model, params, new_config, new_params, tokens


def test_each_layer_learns_the_source_layer(converted, tmp_path):
  model, params, config, new_params, tokens = converted
  recovered, log = local.recover(
    (model, params), (config, new_params), tokens, TRAIN, tmp_path, progress=lambda _: None
  )
  assert [entry["layer"] for entry in log] == [0, 1]
  assert all(entry["loss_after"] < 0.8 * entry["loss_before"] for entry in log), log
  assert json.loads((tmp_path / local.LOG).read_text()) == log
  # Only attention trains: norms and MLPs are the converted model's.
  for i in range(config.num_layers):
    for part in ("attn_norm", "mlp_norm", "mlp"):
      assert jax.tree.all(jax.tree.map(np.array_equal, recovered[f"layers_{i}"][part], new_params[f"layers_{i}"][part]))
  # The reported loss is the relative error of the recovered attention on the source's inputs.
  x = local.hidden_states(model, params, tokens, 4)
  target = local.Layer.of(model.config, 0).attention(params["layers_0"], x)
  pred = local.Layer.of(config, 0).attention(recovered["layers_0"], x)
  np.testing.assert_allclose(float(local.relative_error(pred, target)), log[0]["loss_after"], rtol=1e-4)


def test_an_unchanged_model_has_nothing_to_recover(converted, tmp_path):
  model, params, _, _, tokens = converted
  recovered, log = local.recover(
    (model, params), (model.config, params), tokens, TRAIN, tmp_path, progress=lambda _: None
  )
  assert all(entry["loss_before"] < 1e-10 and entry["loss_after"] == entry["loss_before"] for entry in log)
  assert jax.tree.all(jax.tree.map(np.array_equal, recovered, params))


def test_an_interrupted_recovery_resumes_to_the_same_params(converted, tmp_path):
  model, params, config, new_params, tokens = converted
  whole, _ = local.recover(
    (model, params), (config, new_params), tokens, TRAIN, tmp_path / "a", progress=lambda _: None
  )
  local.recover((model, params), (config, new_params), tokens, TRAIN, tmp_path / "b", progress=lambda _: None)
  # As if killed after layer 0: layer 1's file and log entry gone.
  (tmp_path / "b" / local.FOLDER / "layers_1.safetensors").unlink()
  log = json.loads((tmp_path / "b" / local.LOG).read_text())
  (tmp_path / "b" / local.LOG).write_text(json.dumps(log[:1]))
  done = []
  resumed, _ = local.recover((model, params), (config, new_params), tokens, TRAIN, tmp_path / "b", progress=done.append)
  assert len(done) == 1 and "layer 1" in done[0]  # layer 0 was read back, not trained again
  assert jax.tree.all(jax.tree.map(np.array_equal, resumed, whole))


@pytest.fixture(scope="module")
def source(tmp_path_factory, smollm2) -> Path:
  """The first layer of SmolLM2-135M-Instruct as an imported workdir."""
  from kvjax.conversion.import_model import first_layers

  model, params, _ = checkpoint.load_model(smollm2)
  params, config = first_layers(params, model.config, 1)
  root = tmp_path_factory.mktemp("local") / "source"
  checkpoint.save_params(root, params, config)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(smollm2 / name, root / name)
  return root


@pytest.mark.tier2  # the uptrain command end to end; the recovery's oracles above stay in the first tier
def test_uptrain_recovery_local_from_the_command_line(source, tmp_path, capsys):
  args = ["uptrain", "--from", str(source), "--workdir", str(tmp_path / "mqa"), "--kv-heads", "1", "--method", "pca"]
  args += ["--recovery", "local", "--fraction", "1", "--set", "train.steps=4", "train.batch_size=2"]
  args += ["data.seq_len=32", "data.max_bytes=100000", "train.eval_batches=1", "train.warmup_steps=1"]
  assert main(args) == 0
  assert "recovered (alpha=1.0)" in capsys.readouterr().out
  record = json.loads((tmp_path / "mqa" / "uptrain.json").read_text())
  assert record["recovery"] == "local" and len(record["layers"]) == 1
  assert record["layers"][0]["loss_after"] <= record["layers"][0]["loss_before"]
  model, _, config = checkpoint.load_model(tmp_path / "mqa")
  assert model.config.num_kv_heads == 1 and config["train"]["steps"] == 4
  # Run again: finished, nothing trains; with other settings: refused, naming them.
  assert main(args) == 0
  capsys.readouterr()
  assert main([a.replace("train.steps=4", "train.steps=5") for a in args]) == 2
  assert "other settings (train.steps: 4 -> 5)" in capsys.readouterr().err


def test_bad_recovery_settings_are_refused(source, tmp_path):
  with pytest.raises(ValueError, match="recovery must be one of"):
    uptrain(source, tmp_path / "x", KVHeads(1), fraction=1.0, recovery="layerwise")
  with pytest.raises(ValueError, match="recovery 'local' learns from the source layers alone"):
    uptrain(source, tmp_path / "x", KVHeads(1), fraction=1.0, distill=1.0, recovery="local")
  assert not (tmp_path / "x").exists()
