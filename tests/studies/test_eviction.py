"""The eviction study's driver on SmolLM2, shrunk (configs/eviction/tiny.py): one press beside the
full cache, both recall protocols, perplexity after a pressed context."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import load_module

from kvjax.studies.eviction import EvictionStudy

ROOT = Path(__file__).parents[2]


def test_the_tiny_study_writes_a_row_per_cache(tmp_path):
  config = load_module(ROOT / "configs" / "eviction" / "tiny.py")
  study = config.get_config()
  rows = load_module(config.DRIVER).main(study, tmp_path)
  assert [(r["press"], r["ratio"]) for r in rows] == [("full cache", 0.0), ("snapkv", 0.75)]
  full, snapkv = rows
  # Without a press both protocols are the same computation.
  assert full["recall_query_agnostic"] == full["recall_query_aware"]
  for row in rows:
    assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
    assert {row["recall_query_agnostic"], row["recall_query_aware"]} <= {0.0, 50.0, 100.0}
  assert snapkv["perplexity"] != full["perplexity"]  # the press dropped tokens the continuation reads
  assert json.loads((tmp_path / "eviction.json").read_text()) == rows
  assert "| snapkv |" in (tmp_path / "eviction.md").read_text()


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(presses=("h2o",)), "EvictionStudy.presses: 'h2o' is not one of"),
    (dict(ratios=(1.0,)), "compression_ratio must be a finite number in"),
    (dict(context=64), "EvictionStudy.context must be at least 128"),
    (dict(trials=0), "trials"),
  ],
)
def test_bad_studies_are_refused_naming_the_field(changes, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    EvictionStudy(**changes)
