"""Fixtures the study tests share: the tiny GQA table, run once per test session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvjax.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GQA_TINY = ROOT / "configs" / "gqa_table" / "tiny.py"


def _helpers():
  """tests/conftest.py as a module of its own name: this file is the `conftest` the study tests
  import, so the shared helpers they use from tests/conftest.py are named here too."""
  spec = importlib.util.spec_from_file_location("kvjax_tests_conftest", ROOT / "tests" / "conftest.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_shared = _helpers()
init_params, tiny_config, tree_state = _shared.init_params, _shared.tiny_config, _shared.tree_state


@pytest.fixture(scope="session")
def gqa_tiny(tmp_path_factory) -> Path:
  """The workdir where `kvjax run configs/gqa_table/tiny.py` finished (through kvjax.cli.main):
  gqa_table.{md,csv,json,png}, stages.json, the pre-trained mha_small / mha_big and each
  uptraining's folder. Every test that needs a tiny pre-trained MHA-big (gqa_tiny / "mha_big") or
  the table reads it here; a test that changes files copies it first."""
  workdir = tmp_path_factory.mktemp("gqa_tiny") / "workdir"
  assert main(["run", str(GQA_TINY), "--workdir", str(workdir)]) == 0
  return workdir
