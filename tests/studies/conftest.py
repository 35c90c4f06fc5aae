"""Fixtures the study tests share: the tiny GQA table, run once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvjax.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GQA_TINY = ROOT / "configs" / "gqa_table" / "tiny.py"


@pytest.fixture(scope="session")
def gqa_tiny(tmp_path_factory) -> Path:
  """The workdir where `kvjax run configs/gqa_table/tiny.py` finished (through kvjax.cli.main):
  gqa_table.{md,csv,json,png}, stages.json, the pre-trained mha_small / mha_big and each
  uptraining's folder. Every test that needs a tiny pre-trained MHA-big (gqa_tiny / "mha_big") or
  the table reads it here; a test that changes files copies it first."""
  workdir = tmp_path_factory.mktemp("gqa_tiny") / "workdir"
  assert main(["run", str(GQA_TINY), "--workdir", str(workdir)]) == 0
  return workdir
