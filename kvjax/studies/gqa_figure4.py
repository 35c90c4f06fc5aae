"""The GQA paper's Figure 4: quality after uptraining by each way of building the new K/V heads.

Each of study.methods (mean-pooling, the first head of each group, random initialisation, and
kvjax's data-aware pca and regroup) converts MHA-big to MQA and to GQA, uptrained for alpha =
study.fraction. The study is the table's GqaStudy with job "gqa_figure4"; run in the table's
workdir, it reuses MHA-big and the uptrainings the table made.

Writes gqa_figure4.{md,csv,json,png}. Run: kvjax run configs/gqa_figure4/tiny.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvjax.conversion.conversions import KVHeads
from kvjax.studies.parts import gqa as gs
from kvjax.studies.base import report


def run(study: gs.GqaStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Runs every stage not done yet in `workdir` (reporting each through `progress`), writes
  gqa_figure4.{md,csv,json,png} there; returns the rows."""
  stages = gs.open_stages(study, workdir, progress)
  gs.pretrain(study, stages, "big")
  rows = []
  for conversion in [KVHeads(kv, method) for kv in (1, study.gqa_kv_heads) for method in study.methods]:
    record = stages.done[gs.uptrained(study, stages, conversion).name]
    rows.append(
      {
        "model": study.model_name(conversion.target(study.big)),
        "num_kv_heads": conversion.num_kv_heads,
        "method": conversion.method,
        "converted_bits_per_byte": record["converted"]["bits_per_byte"],
        "bits_per_byte": record["after"]["bits_per_byte"],
        "accuracy": record["after"]["accuracy"],
      }
    )
  stem = workdir / "gqa_figure4"
  table = report.write_table(rows, stem, report.columns_of(rows[0]))
  Path(f"{stem}.md").write_text(f"# GQA Figure 4: conversion methods (alpha = {study.fraction})\n\n{table}\n")
  series = [
    (name, list(range(len(study.methods))), [r["bits_per_byte"] for r in rows if r["model"] == name])
    for name in dict.fromkeys(r["model"] for r in rows)
  ]
  gs.plot(
    Path(f"{stem}.png"),
    series,
    "conversion method: " + ", ".join(study.methods),
    "held-out bits per byte (better: up)",
    f"Figure 4: conversion methods (alpha = {study.fraction})",
    annotate=[list(study.methods)] * len(series),
  )
  return rows
