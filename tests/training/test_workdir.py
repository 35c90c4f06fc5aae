"""Workdir ownership (kvjax.training.workdir): what a claim takes and refuses, with every refused
directory left byte for byte as it was; one process per workdir, with a real second process;
nested claims; fingerprints of a model, and an import's record of its source."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import kvjax
from kvjax.config import ModelConfig
from kvjax.conversion.import_model import import_model
from kvjax.interop.importer import from_hf
from kvjax.interop.hf_export import export_hf
from kvjax.model.transformer import Transformer
from kvjax.training.step import param_initializer
from kvjax.training import workdir as workdirs

HOLDER = """
import sys, time
from kvjax.training import workdir
with workdir.claim(sys.argv[1], "train", {"run": 1}):
  print("held", flush=True)
  time.sleep(120)
"""


def hold(path: Path) -> subprocess.Popen:
  """A second process that claims `path` for the job {"run": 1}, says so, and sleeps."""
  proc = subprocess.Popen(
    [sys.executable, "-c", HOLDER, str(path)],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.stdout.readline() == "held\n"
  return proc


def test_a_new_directory_is_marked_first_and_taken_again_for_its_job(tmp_path):
  path = tmp_path / "a" / "run"
  with workdirs.claim(path, "train", {"run": 1}) as claimed:
    assert claimed == path.resolve() and workdirs.held(path) == "train"
    assert sorted(p.name for p in path.iterdir()) == sorted([workdirs.LOCK, workdirs.MARKER])
    marker = json.loads((path / workdirs.MARKER).read_text())
    assert (marker["kind"], marker["job"]) == ("train", {"run": 1})
    assert marker["kvjax_version"] == workdirs.version() == kvjax.__version__
    holder = json.loads((path / workdirs.LOCK).read_text())
    assert holder["pid"] == os.getpid()
    (path / "config.json").write_text("{}")
  assert workdirs.held(path) is None and (path / workdirs.LOCK).read_text() == ""
  with workdirs.claim(path, "train", {"run": 1}):  # the same job: a resume
    pass
  empty = tmp_path / "empty"
  empty.mkdir()
  with workdirs.claim(empty, "study", {"study": "x"}):
    assert json.loads((empty / workdirs.MARKER).read_text())["kind"] == "study"


def test_a_claim_nests_within_its_process_for_the_same_kind_only(tmp_path):
  with workdirs.claim(tmp_path / "run", "uptrain", {"source": "a"}):
    with workdirs.claim(tmp_path / "run", "uptrain", {"config": {}}):  # train.run inside uptrain
      assert workdirs.held(tmp_path / "run") == "uptrain"
    assert workdirs.held(tmp_path / "run") == "uptrain"
    with pytest.raises(
      workdirs.WorkdirRefused,
      match=r"claimed by this process for another kind of job \(uptrain, "
      r"not train\)",
    ):
      with workdirs.claim(tmp_path / "run", "train", {}):
        pass


def _victims(tmp_path: Path) -> dict[str, tuple[Path, str]]:
  """{case: (directory, what its refusal says)}: each must be left alone by a "train" claim of
  the job {"run": 1}."""
  hf = tmp_path / "hf_model"
  hf.mkdir()
  (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
  (hf / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
  unknown = tmp_path / "notes"
  (unknown / "sub").mkdir(parents=True)
  (unknown / "sub" / "todo.txt").write_text("mine")
  imported, other_run, damaged = tmp_path / "imported", tmp_path / "other_run", tmp_path / "damaged"
  unversioned = tmp_path / "unversioned"  # a workdir of a kvjax from before markers recorded versions
  unversioned.mkdir()
  (unversioned / workdirs.MARKER).write_text('{"kind": "train", "job": {"run": 1}}')
  with workdirs.claim(imported, "import", {"source": "hf"}):
    (imported / "config.json").write_text("{}")
  with workdirs.claim(other_run, "train", {"run": 2}):
    (other_run / "metrics.jsonl").write_text("{}\n")
  damaged.mkdir()
  (damaged / workdirs.MARKER).write_text('{"kind": "train"')
  a_file = tmp_path / "a_file"
  a_file.write_text("data")
  below_a_file = a_file / "run"
  return {
    "hf_model": (hf, r"is not empty \(2 entries: config.json, model.safetensors\) and no kvjax-workdir.json"),
    "unknown_files": (unknown, "is not empty"),
    "another_kind": (imported, r"is a kvjax workdir of another kind \(import, not train\)"),
    "another_job": (other_run, r'workdir of another train job: it records \{"run": 2\}'),
    "damaged_marker": (damaged, "cannot read the workdir marker"),
    "no_version": (unversioned, r"from before workdirs recorded their version .* no kvjax_version"),
    "a_file": (a_file, "is a file, not a directory"),
    "below_a_file": (below_a_file, f"cannot create {below_a_file}: {a_file} is a file"),
  }


def test_every_refusal_leaves_the_directory_byte_identical(tmp_path, snapshot):
  for case, (victim, reason) in _victims(tmp_path).items():
    before = snapshot(tmp_path)
    with pytest.raises(workdirs.WorkdirRefused, match=reason):
      with workdirs.claim(victim, "train", {"run": 1}):
        pytest.fail(f"{case}: claimed")
    with pytest.raises(workdirs.WorkdirRefused, match=reason):
      workdirs.check(victim, "train", {"run": 1})
    assert snapshot(tmp_path) == before, f"{case}: bytes changed"
    assert workdirs.held(victim) is None


def test_an_empty_path_is_refused_not_taken_for_the_current_directory(tmp_path, monkeypatch, snapshot):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "mine.txt").write_text("x")
  before = snapshot(tmp_path)
  for empty in ("", "  "):
    with pytest.raises(workdirs.WorkdirRefused, match="empty path, which would be the current directory"):
      with workdirs.claim(empty, "train", {"run": 1}):
        pass
  assert snapshot(tmp_path) == before


def test_a_second_process_is_refused_naming_the_holder_until_it_is_killed(tmp_path, snapshot):
  path = tmp_path / "run"
  holder = hold(path)
  try:
    before = snapshot(path)
    with pytest.raises(workdirs.WorkdirInUse, match=rf"in use by another kvjax process \(pid {holder.pid} on ") as err:
      with workdirs.claim(path, "train", {"run": 1}):
        pass
    assert f"-c {path})" in str(err.value)  # the holder's command line
    assert snapshot(path) == before
    # A process of another job is refused for that, before it looks at the lock.
    with pytest.raises(workdirs.WorkdirRefused, match="another train job"):
      with workdirs.claim(path, "train", {"run": 2}):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
  # The kernel released the dead holder's lock; its stale pid line does not matter.
  with workdirs.claim(path, "train", {"run": 1}):
    assert json.loads((path / workdirs.LOCK).read_text())["pid"] == os.getpid()


def test_fingerprint_names_the_exact_config_and_weights():
  kernel = lambda: np.arange(6, dtype=np.float32).reshape(2, 3)
  params, config = {"a": {"kernel": kernel()}, "b": np.ones(2, np.float32)}, {"model": {"d_model": 2}}
  same = workdirs.fingerprint({"model": {"d_model": 2}}, {"b": np.ones(2, np.float32), "a": {"kernel": kernel()}})
  assert workdirs.fingerprint(config, params) == same
  flipped = {**params, "b": np.array([1, np.nextafter(np.float32(1), np.float32(2))], np.float32)}  # one bit
  reshaped = {**params, "a": {"kernel": params["a"]["kernel"].reshape(3, 2)}}
  renamed = {"c": params["a"], "b": params["b"]}
  others = [workdirs.fingerprint(config, p) for p in (flipped, reshaped, renamed)]
  others.append(workdirs.fingerprint({"model": {"d_model": 3}}, params))
  others.append(workdirs.fingerprint(config, {**params, "b": jax.numpy.ones(2, jax.numpy.bfloat16)}))  # bf16 too
  assert len({same, *others}) == 6


def test_an_import_records_its_source_and_is_never_redone_over_its_checkpoint(tmp_path, snapshot):
  config = ModelConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=32, max_len=32)
  export_hf(param_initializer(Transformer(config))(jax.random.key(0)), config, tmp_path / "hf")
  import_model(tmp_path / "hf", tmp_path / "imported")
  params, cfg = from_hf(tmp_path / "hf")
  recorded = json.loads((tmp_path / "imported" / workdirs.MARKER).read_text())
  assert recorded["kind"] == "import" and recorded["job"]["source"] == {
    "path": str(tmp_path / "hf"),
    "fingerprint": workdirs.fingerprint(cfg.to_dict(), params),
  }
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match="already holds checkpoints"):
    import_model(tmp_path / "hf", tmp_path / "imported")
  with pytest.raises(workdirs.WorkdirRefused, match=r"is not empty \(2 entries: config.json, model.safetensors\)"):
    import_model(tmp_path / "hf", tmp_path / "hf")
  assert snapshot(tmp_path) == before
