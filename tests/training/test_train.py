"""Training, evaluation, checkpoints and the run / eval / generate commands on a tiny model.

The kill-and-resume test runs `python -m kvjax.cli.main run` in subprocesses, SIGKILLs one after
its first checkpoint, restarts it and compares the final parameters bitwise with an
uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.training import checkpoint
from kvjax.cli import main as cli
from kvjax.training import train
from kvjax.training.step import init_state, make_optimizer, param_initializer
from kvjax.config import ModelConfig
from kvjax.fields import apply_overrides, to_dict
from kvjax.training.data import eval_batches, load_dataset
from kvjax.model.transformer import Transformer
from kvjax.training.config import DataConfig, TrainConfig, TrainRun

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64, max_len=64)
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards pack boxes".split()


def tiny_run(source: str, **train_changes) -> TrainRun:
  train_config = dict(
    steps=60,
    batch_size=8,
    lr=1e-2,
    warmup_steps=5,
    log_every=10,
    eval_every=1000,
    eval_batches=2,
    checkpoint_every=30,
    keep_checkpoints=2,
  )
  return TrainRun(
    model=MODEL,
    data=DataConfig(source=source, seq_len=32, val_fraction=0.1),
    train=TrainConfig(**{**train_config, **train_changes}),
  )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
  rng = random.Random(0)
  path = tmp_path_factory.mktemp("corpus") / "words.txt"
  path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(400)) + "\n")
  return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
  """(workdir, config, summary) of a finished 60-step run."""
  workdir = tmp_path_factory.mktemp("run")
  config = tiny_run(str(corpus))
  return workdir, config, train.run(config, workdir)


def records(workdir: Path, kind: str) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_loss_falls_and_run_is_recorded(trained):
  workdir, _, summary = trained
  logged = records(workdir, "train")
  assert [r["step"] for r in logged] == [10, 20, 30, 40, 50, 60]
  assert logged[0]["loss"] > 3.5  # near ln 256 = 5.55 at the start
  assert summary["val_loss"] < logged[0]["loss"] - 1.5
  assert logged[-1]["loss"] < logged[0]["loss"] - 1.5
  assert summary["step"] == 60 and summary["bits_per_byte"] == pytest.approx(summary["val_loss"] / math.log(2))
  assert summary["tokens_per_s"] > 0 and summary["mfu"] > 0
  assert records(workdir, "eval")[-1]["val_loss"] == summary["val_loss"]
  assert sorted(int(p.name) for p in checkpoint.checkpoint_dir(workdir).iterdir()) == [30, 60]
  meta = checkpoint.read_meta(workdir)
  assert meta["step"] == 60 and meta["data"]["position"] == 60
  assert meta["corpus"]["sha256"] == json.loads((workdir / "corpus.json").read_text())["sha256"]


def test_uniform_model_scores_8_bits_per_byte(tmp_path):
  path = tmp_path / "random.bin"
  path.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
  data = load_dataset(DataConfig(source=str(path), seq_len=32, val_fraction=0.25))
  model = Transformer(MODEL)
  params = param_initializer(model)(jax.random.key(0))
  params = {**params, "lm_head": {"kernel": jnp.zeros_like(params["lm_head"]["kernel"])}}
  metrics = train.evaluate(model, params, data, batch_size=8, num_batches=2)
  # float32's log-softmax over 256 tied logits: a few ulps of log(256), more without XLA's optimizations
  assert metrics["loss"] == pytest.approx(math.log(256), rel=1e-5)
  assert metrics["bits_per_byte"] == pytest.approx(8.0, rel=1e-5)
  # All logits tie, so argmax predicts byte 0: accuracy is the share of zero bytes in the targets.
  targets = np.concatenate([y for _, y in eval_batches(data.val, 32, 8, 2)])
  assert metrics["accuracy"] == pytest.approx(np.mean(targets == 0))


def test_eval_command_matches_the_run(trained, capsys):
  workdir, _, summary = trained
  assert cli.main(["eval", "--workdir", str(workdir), "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["step"] == 60
  assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
  assert result["accuracy"] == summary["accuracy"]
  # Through an int8 cache: a prefill that reads the quantized K/V, close to the float model.
  assert cli.main(["eval", "--workdir", str(workdir), "--json", "--set", "cache.dtype=int8"]) == 0
  quantized = json.loads(capsys.readouterr().out)
  assert quantized["cache"]["dtype"] == "int8" and quantized["loss"] != result["loss"]
  assert quantized["loss"] == pytest.approx(result["loss"], rel=0.01)


def test_generate_continues_greedily_with_the_cache(trained, capsys):
  workdir, _, _ = trained
  prompt = "the quick"
  assert (
    cli.main(
      ["generate", "--workdir", str(workdir), "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "0"]
    )
    == 0
  )
  printed = capsys.readouterr().out
  # Oracle: greedy decoding by full forward passes over the growing sequence, no cache.
  # Causal, so zero padding after position n does not change the logits at n: one compilation.
  model, params, _ = checkpoint.load_model(workdir)
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
  tokens = np.zeros((1, 32), np.int32)
  tokens[0, : len(prompt)] = list(prompt.encode())
  for n in range(len(prompt), len(prompt) + 10):
    tokens[0, n] = int(jnp.argmax(forward(params, tokens)[0, n - 1]))
  expected = bytes(tokens[0, len(prompt) : len(prompt) + 10].tolist()).decode("utf-8", errors="replace")
  assert printed == expected + "\n"
  assert any(c.isalpha() for c in expected)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path):
  config = tiny_run(str(corpus), lr=1e30, warmup_steps=0, steps=20, checkpoint_every=1)
  with pytest.raises(train.TrainingDiverged, match="diverged at step 2") as err:
    train.run(config, tmp_path)
  assert str(checkpoint.step_dir(tmp_path, 1)) in str(err.value)
  assert checkpoint.latest_step(tmp_path) == 1
  _, params, _ = checkpoint.load_model(tmp_path)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_config_diffs_name_fields_a_saved_config_lacks():
  saved = {"model": {"d_model": 32}, "data": {"seq_len": 16}, "train": {"steps": 5}}
  new = {"model": {"d_model": 64}, "data": {"seq_len": 16, "held_out": "spread"}, "train": {"steps": 9}}
  assert checkpoint.config_diffs(saved, new, checkpoint.RESUMABLE_KEYS) == [
    "data.held_out: (not recorded: written before kvjax had this field) -> 'spread'",
    "model.d_model: 32 -> 64",
  ]


def test_mismatched_config_is_refused(trained, tmp_path, capsys):
  workdir, config, _ = trained
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  (copy / "config.json").write_text(json.dumps(to_dict(config), indent=2) + "\n")
  before = {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
  other = apply_overrides(config, ["model.d_model=64"])
  with pytest.raises(ValueError, match=r"holds checkpoints of a different config \(model.d_model: 32 -> 64"):
    train.run(other, copy)
  # Another held-out split would train on other bytes; a run without the field predates it.
  with pytest.raises(ValueError, match=r"data.held_out: 'spread' -> 'tail'"):
    train.run(apply_overrides(config, ["data.held_out=tail"]), copy)
  config_file = tmp_path / "tiny.py"
  config_file.write_text(
    "from kvjax.config import ModelConfig\nfrom kvjax.training.config import DataConfig, TrainConfig, TrainRun\n"
    f"def get_config():\n  return {config!r}\n"
  )
  assert cli.main(["run", str(config_file), "--workdir", str(copy), "--set", "model.num_layers=2"]) == 2
  assert f"{copy} holds checkpoints of a different config" in capsys.readouterr().err
  assert {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_corrupt_checkpoint_errors_name_the_path(trained, tmp_path):
  workdir, config, _ = trained
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  latest = checkpoint.step_dir(copy, 60)
  for path in (latest / "params").rglob("*"):
    if path.is_file():
      path.write_bytes(b"not a checkpoint")
  damaged = f"checkpoint step 60 of {copy} is damaged: params/_METADATA is not valid JSON"
  with pytest.raises(ValueError, match=damaged):
    checkpoint.load_model(copy)
  with pytest.raises(ValueError, match=damaged):
    train.run(config, copy)
  assert (latest / "params").is_dir() and checkpoint.latest_step(copy) == 60
  (latest / "meta" / "metadata").write_text("{ truncated")
  with pytest.raises(ValueError, match=f"checkpoint step 60 of {copy} is damaged: meta/metadata is not valid"):
    checkpoint.read_meta(copy)
  with pytest.raises(ValueError, match="no checkpoint found in"):
    checkpoint.load_model(tmp_path / "empty")


def test_save_params_is_loadable_and_never_overwrites(tmp_path):
  model = Transformer(MODEL)
  params = param_initializer(model)(jax.random.key(1))
  path = checkpoint.save_params(tmp_path, params, MODEL)
  assert path == checkpoint.step_dir(tmp_path, 0)
  loaded_model, loaded, config = checkpoint.load_model(tmp_path)
  assert loaded_model.config == MODEL and config["job"] == "import"
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)))
  with pytest.raises(ValueError, match="already holds checkpoints"):
    checkpoint.save_params(tmp_path, params, MODEL)
  with pytest.raises(ValueError, match="params do not match the model config"):
    checkpoint.save_params(tmp_path / "other", params, MODEL.replace(d_model=64))


def _run_cli(config_file: Path, workdir: Path, cache: Path) -> subprocess.Popen:
  # The three runs share a compilation cache: later runs load the first one's executables.
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "JAX_COMPILATION_CACHE_DIR": str(cache),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  return subprocess.Popen(
    [sys.executable, "-m", "kvjax.cli.main", "run", str(config_file), "--workdir", str(workdir)],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _complete_steps(workdir: Path) -> list[int]:
  folder = checkpoint.checkpoint_dir(workdir)
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


@pytest.mark.tier2
def test_sigkill_and_resume_is_bitwise_exact(corpus, tmp_path):
  config = tiny_run(str(corpus), steps=600, checkpoint_every=50, log_every=50)
  config_file = tmp_path / "configs" / "resume.py"
  config_file.parent.mkdir()
  config_file.write_text(
    "from kvjax.config import ModelConfig\nfrom kvjax.training.config import DataConfig, TrainConfig, TrainRun\n"
    f"def get_config():\n  return {config!r}\n"
  )

  full = _run_cli(config_file, tmp_path / "full", tmp_path / "jax_cache")
  out, _ = full.communicate(timeout=300)
  assert full.returncode == 0, out

  killed = _run_cli(config_file, tmp_path / "killed", tmp_path / "jax_cache")
  deadline = time.monotonic() + 300
  while not _complete_steps(tmp_path / "killed") and killed.poll() is None and time.monotonic() < deadline:
    time.sleep(0.005)
  killed.send_signal(signal.SIGKILL)
  killed.communicate(timeout=60)
  assert killed.returncode == -signal.SIGKILL
  at_kill = checkpoint.latest_step(tmp_path / "killed")
  assert at_kill is not None and at_kill < 600, "the run must be killed between checkpoints"

  resumed = _run_cli(config_file, tmp_path / "killed", tmp_path / "jax_cache")
  out, _ = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, out
  assert f"resuming at step {at_kill}" in out

  _, want, _ = checkpoint.load_model(tmp_path / "full")
  _, got, _ = checkpoint.load_model(tmp_path / "killed")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
  # The metrics read as one run: every logged step once, with the uninterrupted run's losses.
  full_log, resumed_log = records(tmp_path / "full", "train"), records(tmp_path / "killed", "train")
  assert [r["step"] for r in resumed_log] == [r["step"] for r in full_log]
  assert [r["loss"] for r in resumed_log] == [r["loss"] for r in full_log]


def test_init_params_must_match_the_model():
  model = Transformer(MODEL)
  optimizer = make_optimizer(TrainConfig())
  params = param_initializer(model)(jax.random.key(0))
  state = init_state(model, optimizer, jax.random.key(1), params)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)))
  wrong = {**params, "lm_head": {"kernel": jnp.zeros((32, 300))}}
  with pytest.raises(ValueError, match="init_params do not match the model config"):
    init_state(model, optimizer, jax.random.key(1), wrong)


def _files(folder: Path) -> dict:
  return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def test_resume_rules_for_train_steps(corpus, tmp_path, capsys):
  """train.steps may change on resume only while the steps taken lie in the warmup, and the run
  is then bitwise the longer one; past the warmup, or below the steps taken, the resume is
  refused before anything is written; rerunning a finished run writes nothing."""
  schedule = dict(warmup_steps=20, checkpoint_every=10)
  train.run(tiny_run(str(corpus), steps=30, log_every=1, **schedule), tmp_path / "full")
  grown = tmp_path / "grown"
  train.run(tiny_run(str(corpus), steps=10, log_every=4, **schedule), grown)
  config = tiny_run(str(corpus), steps=30, log_every=4, **schedule)
  config_file = tmp_path / "grown.py"
  config_file.write_text(
    "from kvjax.config import ModelConfig\nfrom kvjax.training.config import DataConfig, TrainConfig, TrainRun\n"
    f"def get_config():\n  return {config!r}\n"
  )
  assert cli.main(["run", str(config_file), "--workdir", str(grown)]) == 0
  assert "resuming at step 10" in capsys.readouterr().out
  assert checkpoint.read_meta(grown)["checksums"] == checkpoint.read_meta(tmp_path / "full")["checksums"]

  # The first line after the resume at step 10 averages steps 11 and 12 only, and says so.
  per_step = {r["step"]: r["loss"] for r in records(tmp_path / "full", "train")}
  logged = {r["step"]: r for r in records(grown, "train")}
  assert {s: r["steps_averaged"] for s, r in logged.items()} == {
    4: 4,
    8: 4,
    10: 2,
    12: 2,
    16: 4,
    20: 4,
    24: 4,
    28: 4,
    30: 2,
  }
  assert logged[12]["loss"] == (per_step[11] + per_step[12]) / 2
  assert logged[16]["loss"] == (per_step[13] + per_step[14] + per_step[15] + per_step[16]) / 4

  before = _files(grown)
  with pytest.raises(
    ValueError,
    match=r"train.steps=30 at step 30, past its 20 warmup steps.*"
    r"train.steps=40 in another --workdir.*kvjax uptrain --from",
  ):
    train.run(apply_overrides(config, ["train.steps=40"]), grown)
  with pytest.raises(ValueError, match="holds a checkpoint at step 30, past train.steps=20"):
    train.run(apply_overrides(config, ["train.steps=20"]), grown)
  assert cli.main(["run", str(config_file), "--workdir", str(grown), "--set", "train.steps=40"]) == 2
  assert "past its 20 warmup steps" in capsys.readouterr().err
  assert _files(grown) == before
  summary = train.run(config, grown)
  assert summary["step"] == 30 and summary["val_loss"] == records(grown, "eval")[-1]["val_loss"]
  assert cli.main(["run", str(config_file), "--workdir", str(grown)]) == 0
  assert "finished at step 30; nothing to train" in capsys.readouterr().out
  assert _files(grown) == before
