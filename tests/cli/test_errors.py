"""The command line against bad input and directories it must not write: every anticipated error
is one `kvjax CMD: error: ...` line on stderr with exit status 2 and no traceback, and a refused
workdir keeps every byte (and mtime) it had. The lock, the read-only workdir and the library
noise are checked in real `kvjax` processes; a bug still shows its traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

from kvjax.cli import main as cli
from kvjax.config import ModelConfig
from kvjax.model.transformer import Transformer
from kvjax.training import checkpoint, train
from kvjax.training.step import param_initializer
from kvjax.training import workdir as workdirs
from kvjax.training.config import DataConfig, TrainConfig, TrainRun
from conftest import word_corpus

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=64, max_len=64)
HOLDER = """
import sys, time
from kvjax.cli.run import load_config
from kvjax.training import train
with train.claim_workdir(load_config(sys.argv[1]), sys.argv[2]):
  print("held", flush=True)
  time.sleep(120)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
  """A config file of a 4-step run, a finished run of it, and a Hugging Face-like model folder."""
  root = tmp_path_factory.mktemp("cli")
  corpus = word_corpus(root / "words.txt", 0)
  config = TrainRun(
    model=MODEL,
    data=DataConfig(source=str(corpus), seq_len=32, val_fraction=0.1),
    train=TrainConfig(
      steps=4,
      batch_size=4,
      warmup_steps=1,
      log_every=2,
      eval_every=4,
      eval_batches=1,
      checkpoint_every=2,
      keep_checkpoints=1,
    ),
  )
  config_file = root / "tiny.py"
  config_file.write_text(
    "from kvjax.config import ModelConfig\n"
    "from kvjax.training.config import DataConfig, TrainConfig, TrainRun\n"
    f"def get_config():\n  return {config!r}\n"
  )
  run = root / "run"
  train.run(config, run)
  hf = root / "hf_model"
  hf.mkdir()
  (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
  (hf / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
  imported = root / "imported"
  checkpoint.save_params(imported, param_initializer(Transformer(MODEL))(jax.random.key(0)), MODEL)
  return {"root": root, "config": config_file, "run": run, "hf": hf, "imported": imported}


def one_error_line(err: str, command: str) -> str:
  """The `kvjax COMMAND: error:` line of stderr, checked to be the only one and tracebackless."""
  lines = [line for line in err.splitlines() if line.startswith(f"kvjax {command}: error: ")]
  assert len(lines) == 1 and "Traceback" not in err and "absl" not in err, err
  return lines[0]


def kvjax(*args: str, user: int | None = None) -> subprocess.CompletedProcess:
  """`kvjax ARGS` in a fresh process (as uid `user` when given), stdout and stderr captured."""
  prefix = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "MPLCONFIGDIR": tempfile.gettempdir()}
  return subprocess.run(
    [*prefix, sys.executable, "-m", "kvjax.cli.main", *args], env=env, capture_output=True, text=True, timeout=300
  )


def refusals(s: dict[str, Path]) -> list[tuple[list[str], str]]:
  """(command line, what its error line says) for each workdir a command must not write."""
  config, run, hf, imported = str(s["config"]), str(s["run"]), str(s["hf"]), str(s["imported"])
  unknown, a_file = s["root"] / "notes", s["root"] / "a_file"
  unknown.mkdir(exist_ok=True)
  (unknown / "todo.txt").write_text("mine")
  a_file.write_text("data")
  return [
    (["run", config, "--workdir", hf], rf"{hf} is not empty \(2 entries: config.json, model.safetensors\)"),
    (
      ["run", config, "--workdir", run, "--set", "model.d_model=64"],
      rf"{run} holds checkpoints of a different config \(model.d_model: 32 -> 64",
    ),
    (["run", config, "--workdir", imported], r"is a kvjax workdir of another kind \(import, not train\)"),
    (["run", config, "--workdir", str(unknown)], r"is not empty \(1 entry: todo.txt\)"),
    (["run", config, "--workdir", str(a_file)], f"{a_file} is a file, not a directory"),
    (
      ["run", str(ROOT / "configs/kv_memory/tiny.py"), "--workdir", run],
      r"is a kvjax workdir of another kind \(train, not study\)",
    ),
    (
      ["uptrain", "--from", imported, "--workdir", run, "--kv-heads", "1", "--fraction", "0"],
      r"is a kvjax workdir of another kind \(train, not uptrain\)",
    ),
    (["import-hf", hf, "--workdir", run], r"is a kvjax workdir of another kind \(train, not import\)"),
    (["import-hf", hf, "--workdir", hf], "is not empty"),
    (["eval", "--workdir", str(unknown)], "no checkpoint found in"),
    (["eval", "--workdir", str(unknown), "--ruler", "512"], "no checkpoint found in"),
    (["eval", "--workdir", imported, "--ruler", "512"], "has no tokenizer: the RULER suite is for tokenized models"),
    (["eval", "--workdir", imported, "--tasks", "vt"], r"--tasks and --out apply to the RULER-style suite \(--ruler\)"),
    (["run", config, "--workdir", str(s["root"] / "new"), "--set", "model.d_model=-1"], "ModelConfig.d_model"),
    (["run", str(s["root"] / "missing.py")], "config file not found"),
  ]


def test_each_refusal_is_one_line_and_changes_no_byte(setup, snapshot, capsys):
  cases = refusals(setup)
  before = snapshot(setup["root"])
  for argv, reason in cases:
    assert cli.main(argv) == 2, argv
    line = one_error_line(capsys.readouterr().err, argv[0])
    assert re.search(reason, line), (argv, line)
    assert snapshot(setup["root"]) == before, f"{argv}: bytes changed"


def test_an_empty_workdir_is_refused_not_taken_for_the_current_directory(
  setup, tmp_path, monkeypatch, snapshot, capsys
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "mine.txt").write_text("x")
  before = snapshot(tmp_path)
  for argv in (
    ["run", str(setup["config"]), "--workdir", ""],
    ["import", str(setup["hf"]), "--workdir", ""],
    ["uptrain", "--from", str(setup["run"]), "--workdir", "", "--kv-heads", "1"],
  ):
    with pytest.raises(SystemExit) as exit_:
      cli.main(argv)
    assert exit_.value.code == 2
    line = one_error_line(capsys.readouterr().err, argv[0])
    assert line.endswith("argument --workdir: must name a directory; an empty path would be the current directory")
  assert snapshot(tmp_path) == before


def test_a_run_from_a_kvjax_that_recorded_no_version_is_refused_untouched(setup, tmp_path, snapshot, capsys):
  """kvjax 0.1 reads only workdirs that record its version: one written without (before
  versions were recorded, or with no marker at all) is refused, every byte left as it was."""
  for name, edit in (
    (
      "unversioned",
      lambda marker: marker.write_text(
        json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "kvjax_version"})
      ),
    ),
    ("unmarked", lambda marker: marker.unlink()),
  ):
    old = tmp_path / name
    shutil.copytree(setup["run"], old)
    edit(old / workdirs.MARKER)
    before = snapshot(old)
    assert cli.main(["run", str(setup["config"]), "--workdir", str(old)]) == 2
    line = one_error_line(capsys.readouterr().err, "run")
    assert ("no kvjax_version" if name == "unversioned" else "no kvjax-workdir.json marks it") in line, line
    assert snapshot(old) == before


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_blocks_nothing(setup, tmp_path, snapshot):
  workdir = tmp_path / "run"
  holder = subprocess.Popen(
    [sys.executable, "-c", HOLDER, str(setup["config"]), str(workdir)],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  try:
    assert holder.stdout.readline() == "held\n"
    before = snapshot(workdir)
    second = kvjax("run", str(setup["config"]), "--workdir", str(workdir))
    assert second.returncode == 2
    line = one_error_line(second.stderr, "run")
    assert f"{workdir} is in use by another kvjax process (pid {holder.pid} on " in line
    assert f"-c {setup['config']} {workdir})" in line  # the holder's command line
    assert snapshot(workdir) == before
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
  after_kill = kvjax("run", str(setup["config"]), "--workdir", str(workdir))
  assert after_kill.returncode == 0, after_kill.stderr
  assert checkpoint.latest_step(workdir) == 4


def test_a_read_only_workdir_is_refused(setup, snapshot):
  # Root writes into any directory: the refusal is checked as another user, in a folder it can reach.
  user = 65534 if os.geteuid() == 0 else None
  if user is not None and shutil.which("setpriv") is None:
    pytest.skip("running as root without setpriv: no user for whom a directory is read-only")
  root = Path(tempfile.mkdtemp(prefix="kvjax-ro-"))
  try:
    root.chmod(0o755)
    config = shutil.copy(setup["config"], root / "tiny.py")
    read_only = root / "ro"
    read_only.mkdir(mode=0o555)
    read_only.chmod(0o555)
    before = snapshot(root)
    for workdir, reason in (
      (read_only, f"{read_only} is not writable"),
      (read_only / "run", f"cannot create {read_only / 'run'}: {read_only} is not writable"),
    ):
      proc = kvjax("run", str(config), "--workdir", str(workdir), user=user)
      assert proc.returncode == 2, proc.stderr
      assert one_error_line(proc.stderr, "run").endswith(reason)
    assert snapshot(root) == before
  finally:
    read_only.chmod(0o755)
    shutil.rmtree(root)


def test_orbax_noise_is_silenced_and_the_error_is_the_last_line(setup, tmp_path):
  # A marked workdir whose checkpoints/ is a file: orbax's background cleanup logs its traceback
  # through absl, and the save then fails; only kvjax's line may show.
  workdir = tmp_path / "run"
  with train.claim_workdir(TrainRun(), workdir):
    pass
  (workdir / "checkpoints").write_text("not a folder")
  proc = kvjax("run", str(setup["config"]), "--workdir", str(workdir))
  assert proc.returncode == 2
  line = one_error_line(proc.stderr, "run")
  assert "Not a directory" in line and proc.stderr.rstrip("\n").endswith(line)


def test_a_bug_keeps_its_traceback(tmp_path):
  config_file = tmp_path / "broken.py"
  config_file.write_text("def get_config():\n  return {}['job']\n")
  proc = kvjax("run", str(config_file), "--workdir", str(tmp_path / "run"))
  assert proc.returncode == 1
  assert "Traceback" in proc.stderr and proc.stderr.rstrip().endswith("KeyError: 'job'")
  assert not (tmp_path / "run").exists()
