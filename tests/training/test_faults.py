"""Fault injection: kill -9 at seeded random points of training, uptraining and checkpoint saving,
each run resumed to bitwise the uninterrupted result; every kind of checkpoint damage refused by
name, with the workdir left byte-identical.

The processes are real: tests/training/kill_driver.py runs `kvjax` and SIGKILLs itself at a
seeded point (before a training step, or at a write into the workdir: the files of orbax's
temporary folders, its commit renames, the keep-last-N rotation's deletions, metrics.jsonl,
uptrain.json, the workdir's marker and lock), and the next start resumes. A process dies once,
so the kills of a chain fall in successive starts in one workdir, each resuming the last. The
uninterrupted references run under the same driver, which then records every write they make:
kill points are drawn among those. Finished runs are compared through the checksums of their
final checkpoints, which cover every array of the params and the optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.config import ModelConfig
from kvjax.training import checkpoint, train
from kvjax.training.config import DataConfig, TrainConfig, TrainRun
from conftest import tiered

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="the kill driver reads /proc/self/fd")

DRIVER = Path(__file__).with_name("kill_driver.py")
MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=64, max_len=64)
STEPS = 20
# Checkpoints every 5 steps (4 saves, the last two rotating out the oldest) and logs every 3, so
# that resumed runs start logging mid-window.
TRAIN = TrainConfig(
  steps=STEPS,
  batch_size=8,
  lr=1e-2,
  warmup_steps=5,
  log_every=3,
  eval_every=10,
  eval_batches=2,
  checkpoint_every=5,
  keep_checkpoints=2,
)
UPTRAIN_FRACTION, UPTRAIN_STEPS = 0.5, 10
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards pack boxes".split()


class Env:
  def __init__(self, root: Path):
    self.root = root
    rng = random.Random(0)
    self.corpus = root / "words.txt"
    self.corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)) + "\n")
    self.config = TrainRun(
      model=MODEL, data=DataConfig(source=str(self.corpus), seq_len=32, val_fraction=0.1), train=TRAIN
    )
    self.config_file = root / "faults.py"
    self.config_file.write_text(
      "from kvjax.config import ModelConfig\nfrom kvjax.training.config import DataConfig, TrainConfig, TrainRun\n"
      f"def get_config():\n  return {self.config!r}\n"
    )
    # All processes share one compilation cache: the references compile, the rest load.
    self.environ = {
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      "JAX_COMPILATION_CACHE_DIR": str(root / "jax_cache"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }

  def train_args(self, workdir: Path) -> list[str]:
    return ["run", str(self.config_file), "--workdir", str(workdir)]

  def uptrain_args(self, fraction: float):
    return lambda workdir: [
      "uptrain",
      "--from",
      str(self.root / "reference_train"),
      "--workdir",
      str(workdir),
      "--kv-heads",
      "1",
      "--fraction",
      str(fraction),
    ]

  def kvjax(self, args: list[str], *, workdir: Path | None = None, kill_at=None, record: Path | None = None):
    """Runs `kvjax ARGS` -> (exit code, stdout + stderr, stderr, the kill point or None). Under the
    kill driver when a workdir is given, killed at `kill_at` or recording its writes to `record`."""
    if workdir is None:
      command = [sys.executable, "-m", "kvjax.cli.main", *args]
    else:
      plan = self.root / "plan.json"
      last_words = self.root / "last_words.json"
      last_words.unlink(missing_ok=True)
      plan.write_text(
        json.dumps(
          {
            "workdir": str(workdir),
            "kill_at": kill_at,
            "last_words": str(last_words),
            "record": str(record) if record else None,
          }
        )
      )
      command = [sys.executable, str(DRIVER), str(plan), *args]
    done = subprocess.run(command, env=self.environ, capture_output=True, text=True, timeout=300)
    point = None
    if workdir is not None and (self.root / "last_words.json").exists():
      point = json.loads((self.root / "last_words.json").read_text())
    return done.returncode, done.stdout + done.stderr, done.stderr, point


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
  return Env(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def reference(env) -> dict:
  """{"train" | "uptrain" | "zero": (workdir, the writes it made)} of the uninterrupted runs:
  training, uptraining to 1 kv head at alpha 0.5, and the conversion alone (alpha 0)."""
  runs = {"train": env.train_args, "uptrain": env.uptrain_args(UPTRAIN_FRACTION), "zero": env.uptrain_args(0)}
  out = {}
  for name, args_of in runs.items():
    workdir, record = env.root / f"reference_{name}", env.root / f"writes_{name}.json"
    code, output, _, _ = env.kvjax(args_of(workdir), workdir=workdir, record=record)
    assert code == 0, output
    out[name] = (workdir, json.loads(record.read_text()))
  return out


def files(folder: Path) -> dict:
  """{relative path: sha256 of the file, or None for a folder} of everything under `folder`."""
  return {
    p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    for p in folder.rglob("*")
  }


def metrics(workdir: Path) -> dict:
  """{(kind, step): record} of metrics.jsonl; every step logged once."""
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    assert (record["kind"], record["step"]) not in out, line
    out[record["kind"], record["step"]] = record
  return out


def assert_same_run(workdir: Path, ref: Path) -> None:
  """The finished run in `workdir` is the uninterrupted `ref`: bitwise the same arrays (params and
  optimizer state), sampler state and metrics, save that a window cut by a resume averages fewer
  steps (and says so)."""
  want, got = checkpoint.read_meta(ref), checkpoint.read_meta(workdir)
  assert got["step"] == want["step"]
  assert got["checksums"] == want["checksums"]
  assert got.get("data") == want.get("data")
  checkpoint.load_model(workdir)  # restores and verifies
  if (ref / "metrics.jsonl").exists():
    want_log, got_log = metrics(ref), metrics(workdir)
    assert got_log.keys() == want_log.keys()
    for key, record in got_log.items():
      ref_record = want_log[key]
      if key[0] == "eval":
        assert record == ref_record
        continue
      assert record["lr"] == ref_record["lr"] and 1 <= record["steps_averaged"] <= ref_record["steps_averaged"]
      if record["steps_averaged"] == ref_record["steps_averaged"]:
        assert (record["loss"], record["grad_norm"]) == (ref_record["loss"], ref_record["grad_norm"]), key
  if (ref / "uptrain.json").exists():
    assert json.loads((workdir / "uptrain.json").read_text()) == json.loads((ref / "uptrain.json").read_text())


def draw(rng: random.Random, writes: list, resume: int, steps: int) -> list:
  """A kill point [position, n] after step `resume`: in the first writes of the start (before it
  resumes), before a training step, or at one of the reference's later writes: one of a save's
  (inside orbax's temporary folder, or its commit), of the rotation's, or any."""
  u = rng.random()
  if u < 0.15:
    first = sum(1 for w in writes if w[0] == 0) if resume == 0 else 3
    return [0, rng.randint(1, max(first, 1))]
  if u < 0.4 and resume + 1 < steps:
    return [rng.randint(resume + 1, steps - 1), None]
  later = [w for w in writes if w[0] > resume or (resume == 0 and w[0] == 0)]
  saving = [w for w in later if "orbax-checkpoint-tmp" in w[3]]
  rotating = [w for w in later if re.match(r"checkpoints/\d+(/|$)", w[3]) and w[2] in ("delete", "rmdir")]
  position, n, _, _ = rng.choice((saving if u < 0.75 else rotating if u < 0.9 else later) or later)
  return [position, n]


def kill_chain(env: Env, seed: int, name: str, args_of, ref: tuple, steps: int, kills: int) -> list[dict]:
  """`kills` starts of `args_of(workdir)` SIGKILLed at seeded points, each start resuming the
  last; every chain is then finished and must equal the reference. Returns the kill points."""
  rng, (ref_dir, writes) = random.Random(seed), ref
  points, workdir, resume = [], None, 0

  def finish(workdir: Path) -> None:
    code, output, _, _ = env.kvjax(args_of(workdir))
    assert code == 0, output
    assert_same_run(workdir, ref_dir)

  while len(points) < kills:
    if workdir is None:
      workdir, resume = env.root / f"{name}_{len(points)}", 0
    kill_at = draw(rng, writes, resume, steps)
    code, output, _, point = env.kvjax(args_of(workdir), workdir=workdir, kill_at=kill_at)
    if code == 0:  # the run ended before the point came
      assert_same_run(workdir, ref_dir)
      workdir = None
      continue
    assert code == -signal.SIGKILL and point is not None, f"kill at {kill_at}: exit {code}\n{output}"
    points.append(point)
    latest = checkpoint.latest_step(workdir)
    resume = latest or 0
    if latest == steps:  # killed after its last checkpoint: a finished run
      finish(workdir)
      workdir = None
  if workdir is not None:  # the last kill may have fallen after the last checkpoint, finished above
    finish(workdir)
  return points


def kind_of(point: dict) -> str:
  path = point["path"] or ""
  if point["kind"] == "step":
    return "training step"
  if path.startswith("checkpoints/"):
    if "orbax-checkpoint-tmp" in path:
      return "checkpoint save"
    return "checkpoint rotation" if point["kind"] in ("delete", "rmdir") else "checkpoint folder"
  return "metrics" if "metrics.jsonl" in path else "workdir file"


@pytest.mark.tier2
def test_kill_9_anywhere_in_training_resumes_bitwise(env, reference):
  source = files(reference["train"][0])
  points = kill_chain(env, 5, "train", env.train_args, reference["train"], STEPS, kills=9)
  kinds = [kind_of(p) for p in points]
  print("training kill points:", points)
  assert len(points) == 9
  assert kinds.count("training step") >= 2 and kinds.count("checkpoint save") >= 3, kinds
  assert files(reference["train"][0]) == source


@pytest.mark.tier2
def test_kill_9_anywhere_in_uptraining_resumes_bitwise(env, reference):
  source = files(reference["train"][0])
  points = kill_chain(
    env, 2, "uptrain", env.uptrain_args(UPTRAIN_FRACTION), reference["uptrain"], UPTRAIN_STEPS, kills=5
  )
  points += kill_chain(env, 3, "zero", env.uptrain_args(0), reference["zero"], 0, kills=2)
  kinds = [kind_of(p) for p in points]
  print("uptraining kill points:", points)
  assert len(points) == 7
  assert kinds.count("checkpoint save") >= 2, kinds
  assert files(reference["train"][0]) == source  # the source is never modified


# Damage to the latest checkpoint (step STEPS): what it does to STEP_FOLDER, and what the error names.
def _largest(folder: Path) -> Path:
  return max((p for p in folder.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)


def _flip(path: Path, at: float) -> None:
  data = bytearray(path.read_bytes())
  data[int(len(data) * at)] ^= 0x10
  path.write_bytes(bytes(data))


def _rewrite_meta(folder: Path, change) -> None:
  meta = json.loads((folder / "meta" / "metadata").read_text())
  change(meta)
  (folder / "meta" / "metadata").write_text(json.dumps(meta))


DAMAGE = {
  "flipped bytes in params": (lambda f: _flip(_largest(f / "params"), 0.5), "params/\\S+ does not match its checksum"),
  "flipped bytes in opt_state": (
    lambda f: _flip(_largest(f / "opt_state"), 0.5),
    "opt_state/\\S+ does not match its checksum",
  ),
  "truncated array file": (
    lambda f: _largest(f / "params").write_bytes(_largest(f / "params").read_bytes()[:100]),
    "params/\\S+ cannot be read \\(",
  ),
  "deleted array file": (lambda f: _largest(f / "opt_state").unlink(), "opt_state/\\S+ cannot be read \\("),
  "deleted metadata": (lambda f: shutil.rmtree(f / "meta"), "its meta item \\(meta/\\) is missing"),
  "deleted checksums": (
    lambda f: _rewrite_meta(f, lambda m: [m.pop("checksums"), m.pop("digest")]),
    "meta/metadata records no checksums",
  ),
  "altered sampler state": (
    lambda f: _rewrite_meta(f, lambda m: m["data"].update(position=1)),
    "meta/metadata does not match its checksum",
  ),
  "truncated metadata": (
    lambda f: (f / "meta" / "metadata").write_text('{"kind": "tr'),
    "meta/metadata is not valid JSON",
  ),
  "damaged orbax tree metadata": (
    lambda f: (f / "params" / "_METADATA").write_text("{ x"),
    "params/_METADATA is not valid JSON",
  ),
  "damaged orbax manifest": (
    lambda f: (f / "params" / "manifest.ocdbt").write_bytes(b"\0" * 20),
    "params/\\S+ cannot be read \\(.*manifest.ocdbt",
  ),
  "damaged checkpoint metadata": (
    lambda f: (f / "_CHECKPOINT_METADATA").write_text("{ x"),
    "_CHECKPOINT_METADATA is not valid JSON",
  ),
}
COMMANDS = ("eval", "run", "generate", "uptrain")
# The first tier: one kind per command line (eval, generate, uptrain, run), from each file a
# checkpoint holds; the second tier every kind.
FIRST_TIER = ("flipped bytes in params", "truncated array file", "truncated metadata", "damaged orbax manifest")


# A restore that fails leaves orbax's other reads to end as unraisable exceptions (the command
# line drops them, kvjax.cli.main.quiet_library_logs).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", tiered(list(DAMAGE), FIRST_TIER))
def test_checkpoint_damage_is_named_and_refused(kind, env, reference, tmp_path):
  damage, what = DAMAGE[kind]
  copy = tmp_path / "run"
  shutil.copytree(reference["train"][0], copy)
  damage(checkpoint.step_dir(copy, STEPS))
  before = files(copy)
  named = f"checkpoint step {STEPS} of {re.escape(str(copy))} is damaged: {what}"
  with pytest.raises(ValueError, match=named):
    train.run(env.config, copy)
  if "opt_state" not in what:
    with pytest.raises(ValueError, match=named):
      checkpoint.load_model(copy)
  # One command line per kind (resuming for optimizer state, which only a resume reads).
  command = "run" if "opt_state" in what else COMMANDS[list(DAMAGE).index(kind) % len(COMMANDS)]
  args = {
    "eval": ["eval", "--workdir", str(copy)],
    "run": env.train_args(copy),
    "generate": ["generate", "--workdir", str(copy), "--prompt", "the", "--max-new-tokens", "4"],
    "uptrain": env.uptrain_args(0.5)(tmp_path / "dest"),
  }[command]
  if command == "uptrain":
    args[args.index("--from") + 1] = str(copy)
  code, output, stderr, _ = env.kvjax(args)
  assert code == 2, output
  assert re.fullmatch(f"kvjax {command}: error: {named}.*\n", stderr), stderr
  assert files(copy) == before
  assert not (tmp_path / "dest").exists()


def test_last_good_names_only_a_verified_checkpoint(env, tmp_path, monkeypatch):
  """A checkpoint damaged on disk after it was written is not offered as the one to go back to."""
  save = checkpoint.save_train_state

  def save_then_damage(manager, step, *args):
    save(manager, step, *args)
    _flip(_largest(checkpoint.step_dir(tmp_path, step) / "params"), 0.5)

  monkeypatch.setattr(checkpoint, "save_train_state", save_then_damage)
  config = TrainRun(
    model=MODEL,
    data=env.config.data,
    train=TrainConfig(
      steps=20, batch_size=8, lr=1e30, warmup_steps=0, checkpoint_every=1, eval_every=1000, eval_batches=1
    ),
  )
  with pytest.raises(train.TrainingDiverged) as err:
    train.run(config, tmp_path)
  message = str(err.value)
  assert "last good" not in message
  assert re.search(
    # A flipped byte inside a compressed chunk fails decompression before the checksum is read.
    r"no checkpoint is good: checkpoint step \d+ of \S+ is damaged: params/\S+ "
    r"(does not match its checksum|cannot be read)",
    message,
  ), message
