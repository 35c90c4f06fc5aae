"""The README's quickstart runs as printed: the first Python a new user copies."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_quickstart_runs_and_generates_what_it_says():
  code = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
  names: dict = {}
  exec(compile(code, str(README), "exec"), names)
  assert names["tokens"].shape == (2, 32)
  assert names["mqa_config"].num_kv_heads == 1
  assert [len(tokens) for tokens in names["out"].values()] == [32]


def test_the_readme_is_short_and_starts_with_its_two_commands():
  lines = README.read_text().splitlines()
  assert len(lines) <= 150
  commands = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
  assert "kvjax run configs/gqa_table/tiny.py" in commands[0] and "pytest" in commands[1]


def test_every_headline_number_is_in_the_results():
  """Each decimal of the README's headline table is a figure of docs/results.md, written the same
  way: a headline moves with its table, never ahead of it or behind."""
  text = README.read_text()
  table = text[text.index("| what | result |") : text.index("## Quickstart")]
  results = (README.parent / "docs" / "results.md").read_text()
  missing = [
    (number, row.split(" | ")[0])
    for row in table.splitlines()[2:]
    for number in re.findall(r"\d+\.\d+(?:e-?\d+)?", row.split(" | ")[-1])
    if number not in results
  ]
  assert not missing, missing


def test_the_design_notes_layers_are_the_import_contracts():
  """docs/design.md's layer chain, top to bottom, is pyproject.toml's layers contract over kvjax's
  packages (the studies and the benchmarks have layers contracts of their own)."""
  import tomllib

  root = README.parent
  design = (root / "docs" / "design.md").read_text()
  chain = re.search(r"## Layers\n\n```\n(.*?)```", design, re.S).group(1)
  drawn = [part.strip() for part in " ".join(chain.split()).split("->")]
  contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
  (layers,) = [c["layers"] for c in contracts if c["type"] == "layers" and c["containers"] == ["kvjax"]]
  assert drawn == layers
