"""Uptraining's provenance: its workdir records the source (path, step, fingerprint of config and
params) and the conversion, and refuses to be resumed from another source, from its own source
once that has changed, or by another conversion, naming both and leaving every byte of the
workdir as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvjax.config import ModelConfig
from kvjax.conversion.conversions import KVHeads
from kvjax.conversion.uptrain import uptrain
from kvjax.training import checkpoint, train
from kvjax.training import workdir as workdirs
from conftest import tiny_run, word_corpus

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=64, max_len=64)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
  """Two 4-step MHA runs of one config, from different seeds: other weights, the same settings."""
  root = tmp_path_factory.mktemp("sources")
  corpus = word_corpus(root / "words.txt", 0)
  for seed, name in enumerate("ab"):
    train.run(tiny_run(MODEL, corpus, 4, seed=seed), root / name)
  return root / "a", root / "b"


def source_id(path: Path) -> dict:
  _, params, config = checkpoint.load_model(path)
  return {"path": str(path), "step": 4, "fingerprint": workdirs.fingerprint(config, params)}


def marker(path: Path) -> dict:
  return json.loads((path / workdirs.MARKER).read_text())


def test_an_uptraining_records_its_source_and_refuses_another(sources, tmp_path, snapshot):
  a, b = sources
  dest = tmp_path / "mqa"
  record = uptrain(a, dest, KVHeads(1), fraction=0.5)
  assert record["source"] == str(a) and checkpoint.latest_step(dest) == 2
  recorded = marker(dest)
  assert recorded["kind"] == "uptrain" and recorded["job"]["source"] == source_id(a)
  assert recorded["job"]["conversion"] == record["conversion"] == {"num_kv_heads": 1, "method": "mean", "seed": 0}
  assert source_id(a)["fingerprint"] != source_id(b)["fingerprint"]
  before = snapshot(dest)
  fp_a, fp_b = source_id(a)["fingerprint"][:12], source_id(b)["fingerprint"][:12]
  with pytest.raises(
    workdirs.WorkdirRefused,
    match=rf"{dest} holds an uptraining of {a} at step 4 \(fingerprint "
    rf"{fp_a}\), not of {b} at step 4 \(fingerprint {fp_b}\)",
  ):
    uptrain(b, dest, KVHeads(1), fraction=0.5)
  with pytest.raises(
    workdirs.WorkdirRefused,
    match=r"holds an uptraining with conversion kv1_mean, fraction 0.5, "
    r"not conversion kv1_first, fraction 0.5",
  ):
    uptrain(a, dest, KVHeads(1, "first"), fraction=0.5)
  assert snapshot(dest) == before
  assert uptrain(a, dest, KVHeads(1), fraction=0.5)["after"] == record["after"]  # its own source: resumed, finished


def test_a_source_changed_in_place_is_refused(sources, tmp_path, snapshot):
  a, b = sources
  source, dest = tmp_path / "source", tmp_path / "mqa"
  shutil.copytree(a, source)
  uptrain(source, dest, KVHeads(1), fraction=0)
  shutil.rmtree(source)
  shutil.copytree(b, source)  # the same path, other weights
  before = snapshot(dest)
  fp_a, fp_b = source_id(a)["fingerprint"][:12], source_id(b)["fingerprint"][:12]
  with pytest.raises(
    workdirs.WorkdirRefused,
    match=rf"holds an uptraining of {source} at step 4 \(fingerprint "
    rf"{fp_a}\), and that source has changed since: it is now {source} at step 4 "
    rf"\(fingerprint {fp_b}\)",
  ):
    uptrain(source, dest, KVHeads(1), fraction=0)
  assert snapshot(dest) == before
