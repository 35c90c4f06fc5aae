"""The paper's path after a layer-local recovery: `kvjax uptrain --distill W --init RECOVERED`
trains end to end from the recovered params with the source as the teacher, resumes exactly, is
refused an init of another source or conversion, and records the gap it closes against its
steps (kvjax.conversion.curve)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax.cli.main import main
from kvjax.config import ModelConfig
from kvjax.conversion import curve
from kvjax.conversion.conversions import KVHeads
from kvjax.conversion.uptrain import uptrain
from kvjax.fields import from_dict
from kvjax.training import checkpoint, train
from kvjax.training import workdir as workdirs
from kvjax.training.config import DataConfig, TrainConfig, TrainRun
from conftest import word_corpus

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=4, mlp_dim=64, max_len=64)
# Eval every step; warmup 1: the first step's learning rate is 0, so its eval is the init's quality.
DISTILL = ["train.eval_every=1", "train.log_every=1", "train.checkpoint_every=2", "train.warmup_steps=1"]


def pretraining(corpus: Path, seed: int) -> TrainRun:
  return TrainRun(
    model=MODEL,
    data=DataConfig(source=str(corpus), seq_len=32, val_fraction=0.1),
    train=TrainConfig(
      steps=4, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=1, checkpoint_every=4, seed=seed
    ),
  )


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
  """Two 4-step MHA runs (seeds 0, 1); a layer-local recovery of run a to MQA by mean-pooling, and
  conversions at alpha 0 (finished uptrainings too): of run a by `first` and by mean-pooling, of
  run b by mean-pooling."""
  root = tmp_path_factory.mktemp("distill")
  corpus = word_corpus(root / "words.txt", 0)
  for seed, name in enumerate("ab"):
    train.run(pretraining(corpus, seed), root / name)
  uptrain(
    root / "a",
    root / "a_mean",
    KVHeads(1),
    fraction=1.0,
    recovery="local",
    local_windows=8,
    overrides=["train.lr=0.01"],
  )
  for name, source, conversion in (
    ("a_first", "a", KVHeads(1, "first")),
    ("a_mean0", "a", KVHeads(1)),
    ("b_mean", "b", KVHeads(1)),
  ):
    uptrain(root / source, root / name, conversion, fraction=0)
  return {name: root / name for name in ("a", "b", "a_mean", "a_first", "a_mean0", "b_mean")}


def leaves(workdir: Path) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(checkpoint.load_model(workdir)[1])]


def distill_args(source: Path, dest: Path, init: Path) -> list[str]:
  args = ["uptrain", "--from", str(source), "--workdir", str(dest), "--kv-heads", "1", "--fraction", "1"]
  return args + ["--distill", "1", "--init", str(init), "--set", *DISTILL]


@pytest.fixture(scope="module")
def distilled(sources, tmp_path_factory) -> Path:
  dest = tmp_path_factory.mktemp("distilled") / "mqa"
  assert main(distill_args(sources["a"], dest, sources["a_mean"])) == 0
  return dest


def test_training_starts_from_the_recovery_and_records_the_curve(sources, distilled, capsys):
  record = json.loads((distilled / "uptrain.json").read_text())
  local = json.loads((sources["a_mean"] / "uptrain.json").read_text())
  assert record["init"]["path"] == str(sources["a_mean"]) and record["init"]["recovery"] == "local"
  # The init's quality, measured here on the same held-out data as the recovery's own figure.
  assert record["recovered"] == local["after"] and record["before"] == local["before"]
  assert record["recovered"]["loss"] < record["converted"]["loss"]
  evals = curve.eval_lines(distilled / "metrics.jsonl")
  assert [e["step"] for e in evals] == [1, 2, 3, 4]
  # The first step moved nothing (learning rate 0): its eval is the recovered model's quality.
  assert evals[0]["val_loss"] == pytest.approx(record["recovered"]["loss"], rel=1e-6)
  assert abs(evals[0]["val_loss"] - record["converted"]["loss"]) > 1e-3
  gap = record["converted"]["loss"] - record["before"]["loss"]
  losses = [record["recovered"]["loss"]] + [e["val_loss"] for e in evals]
  assert record["curve"] == [
    {"step": s, "val_loss": loss, "gap_closed": pytest.approx((record["converted"]["loss"] - loss) / gap, rel=1e-9)}
    for s, loss in zip(range(5), losses)
  ]
  assert record["after"]["loss"] == evals[-1]["val_loss"]
  # Run again: finished; the command prints the init's row and the curve.
  assert main(distill_args(sources["a"], distilled, sources["a_mean"])) == 0
  out = capsys.readouterr().out
  assert "init (local)" in out and "step 4" in out and "gap closed" in out


def test_the_teacher_is_the_source_model(sources, distilled, tmp_path):
  """The same run assembled by hand from train.run: with the source as teacher, bitwise the
  uptraining's params; with the recovered model as teacher, other params."""
  config = from_dict(TrainRun, json.loads((distilled / "config.json").read_text()))
  source_model, source_params, _ = checkpoint.load_model(sources["a"])
  recovered_model, recovered, _ = checkpoint.load_model(sources["a_mean"])
  copy = lambda params: jax.tree.map(np.array, params)  # a run's state is donated to its steps
  train.run(config, tmp_path / "source", init_params=copy(recovered), teacher=(source_model, source_params))
  train.run(config, tmp_path / "recovered", init_params=copy(recovered), teacher=(recovered_model, recovered))
  want = leaves(distilled)
  assert all(np.array_equal(a, b) for a, b in zip(want, leaves(tmp_path / "source")))
  assert not all(np.array_equal(a, b) for a, b in zip(want, leaves(tmp_path / "recovered")))


def test_an_interrupted_distillation_resumes_to_the_same_params(sources, distilled, tmp_path):
  dest = tmp_path / "mqa"
  shutil.copytree(distilled, dest)
  # As if killed after the step-2 checkpoint: step 4's checkpoint, its metrics and the results gone.
  shutil.rmtree(checkpoint.step_dir(dest, 4))
  record = json.loads((dest / "uptrain.json").read_text())
  del record["after"], record["curve"]
  (dest / "uptrain.json").write_text(json.dumps(record))
  lines = (dest / "metrics.jsonl").read_text().splitlines()
  (dest / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= 3))
  assert checkpoint.latest_step(dest) == 2
  resumed = uptrain(
    sources["a"], dest, KVHeads(1), fraction=1.0, distill=1.0, init=sources["a_mean"], overrides=DISTILL
  )
  assert all(np.array_equal(a, b) for a, b in zip(leaves(distilled), leaves(dest)))
  assert resumed["curve"] == json.loads((distilled / "uptrain.json").read_text())["curve"]


def test_an_init_of_another_source_or_conversion_is_refused(sources, distilled, tmp_path, snapshot):
  a, dest = sources["a"], tmp_path / "mqa"
  run = lambda init, where=dest: uptrain(a, where, KVHeads(1), fraction=1.0, distill=1.0, init=init, overrides=DISTILL)
  with pytest.raises(ValueError, match=rf"--init {sources['b_mean']} is an uptraining of {sources['b']} at step 4"):
    run(sources["b_mean"])
  with pytest.raises(ValueError, match=rf"--init {sources['a_first']} holds conversion kv1_first, not kv1_mean"):
    run(sources["a_first"])
  with pytest.raises(ValueError, match=rf"--init {a} is a 'train' workdir, not an uptraining's"):
    run(a)
  with pytest.raises(ValueError, match=r"init=.* starts an end-to-end uptraining \(recovery 'train'"):
    uptrain(a, dest, KVHeads(1), fraction=1.0, recovery="local", init=sources["a_mean"])
  assert not dest.exists()
  # A distillation in progress resumes only from the init it began with.
  other = sources["a_mean0"]
  before = snapshot(distilled)
  with pytest.raises(workdirs.WorkdirRefused, match=rf"not conversion kv1_mean, .*init {other} at step 0"):
    run(other, distilled)
  assert snapshot(distilled) == before


def test_the_gap_closed_curve_from_a_metrics_log(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  lines = [
    {"step": 5, "kind": "train", "loss": 9.0},
    {"step": 10, "kind": "eval", "val_loss": 2.5, "val_accuracy": 0.4},
    {"step": 5, "kind": "eval", "val_loss": 2.75},
    {"step": 20, "kind": "eval", "val_loss": 1.5},
  ]
  metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
  # The gap runs from 3.0 (alpha 0) to 2.0 (the source); the recovery started at 2.9.
  assert curve.gap_closed_curve(3.0, 2.0, 2.9, curve.eval_lines(metrics)) == [
    {"step": 0, "val_loss": 2.9, "gap_closed": pytest.approx(0.1)},
    {"step": 5, "val_loss": 2.75, "gap_closed": 0.25},
    {"step": 10, "val_loss": 2.5, "gap_closed": 0.5},
    {"step": 20, "val_loss": 1.5, "gap_closed": 1.5},
  ]
  assert curve.gap_closed_curve(2.0, 2.0, 2.0, []) == [{"step": 0, "val_loss": 2.0, "gap_closed": None}]
  assert math.isclose(curve.gap_closed(math.log(2), math.log(4), 0.0), 0.5)
