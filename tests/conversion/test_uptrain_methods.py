"""Uptraining with the data-aware conversions and distillation, end to end on a tiny source run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvjax.config import ModelConfig
from kvjax.conversion.conversions import KVHeads
from kvjax.conversion.uptrain import uptrain
from kvjax.training import train
from conftest import tiny_run, word_corpus

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=4, mlp_dim=64, max_len=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("source")
  corpus = word_corpus(root / "words.txt", 1)
  train.run(tiny_run(MODEL, corpus, 8), root / "mha")
  return root / "mha"


def test_pca_with_distillation_uptrains_and_records_its_settings(source, tmp_path):
  record = uptrain(source, tmp_path / "gqa", KVHeads(2, "pca"), fraction=0.5, distill=0.5)
  assert record["conversion"] == {"num_kv_heads": 2, "method": "pca", "seed": 0}
  assert record["distill"] == 0.5 and record["steps"] == 4
  saved = json.loads((tmp_path / "gqa" / "config.json").read_text())
  assert saved["train"]["distill"] == 0.5 and saved["model"]["num_kv_heads"] == 2
  assert record["converted"]["loss"] < record["before"]["loss"] + 5  # finite and measured
  # The same workdir with another distillation weight is another job: refused.
  with pytest.raises(ValueError, match="distill"):
    uptrain(source, tmp_path / "gqa", KVHeads(2, "pca"), fraction=0.5, distill=1.0)


def test_regroup_at_alpha_zero(source, tmp_path):
  record = uptrain(source, tmp_path / "mqa", KVHeads(1, "regroup"), fraction=0.0)
  assert (
    record["conversion"] == {"num_kv_heads": 1, "method": "regroup", "seed": 0}
    and record["after"] == record["converted"]
  )


def test_a_conversion_that_does_not_fit_the_source_is_refused_before_anything_is_written(source, tmp_path):
  with pytest.raises(ValueError, match="KVHeads.num_kv_heads=3: cannot convert 4 kv heads to 3"):
    uptrain(source, tmp_path / "gqa", KVHeads(3))
  with pytest.raises(ValueError, match="conversion must be a KVHeads or ToMLA"):
    uptrain(source, tmp_path / "gqa", 2)
  assert not (tmp_path / "gqa").exists()
