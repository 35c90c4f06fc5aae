"""The study writer: csv / json / markdown of one table, and figures that leave matplotlib's
global backend alone."""

from __future__ import annotations

import csv
import json

import matplotlib

from kvjax.studies.base import report

ROWS = [
  {"model": "MHA", "kv_heads": 8, "loss": 1.23456, "note": None},
  {"model": "MQA", "kv_heads": 1, "loss": 1.5, "note": "uptrained", "extra": [1, 2]},
]
COLUMNS = [("model", "model", ""), ("kv_heads", "kv heads", "d"), ("loss", "loss", ".3f"), ("note", "note", "")]


def test_write_table_writes_csv_json_and_returns_markdown(tmp_path):
  text = report.write_table(ROWS, tmp_path / "t", COLUMNS)
  with open(tmp_path / "t.csv") as f:
    table = list(csv.reader(f))
  assert table == [["model", "kv_heads", "loss", "note"], ["MHA", "8", "1.23456", ""], ["MQA", "1", "1.5", "uptrained"]]
  assert json.loads((tmp_path / "t.json").read_text()) == ROWS
  assert text.splitlines() == [
    "| model | kv heads | loss | note |",
    "|---|---|---|---|",
    "| MHA | 8 | 1.235 |  |",
    "| MQA | 1 | 1.500 | uptrained |",
  ]


def test_columns_of_formats_floats_only():
  assert report.columns_of(ROWS[0]) == [
    ("model", "model", ""),
    ("kv_heads", "kv_heads", ""),
    ("loss", "loss", ".4f"),
    ("note", "note", ""),
  ]
  assert report.markdown_table([{"u": 0.9634}], [("u", "utilisation", ".1%")]).endswith("| 96.3% |")


def test_figure_writes_a_png_and_keeps_the_global_backend(tmp_path):
  before = matplotlib.get_backend()
  matplotlib.use("svg")
  try:
    with report.figure(tmp_path / "f.png", panels=2) as (left, right):
      report.plot_series(
        left, [("a", [0, 1], [2, 1]), ("b", [0.5], [1.5])], "x", "y", "t", annotate=[["p", "q"], ["r"]], invert_y=True
      )
      right.bar(["u", "v"], [1, 2])
    assert matplotlib.get_backend() == "svg"
    assert left.yaxis_inverted() and [t.get_text() for t in left.texts] == ["p", "q", "r"]
  finally:
    matplotlib.use(before)
  assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
