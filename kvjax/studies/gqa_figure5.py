"""The GQA paper's Figure 5: quality against the uptraining proportion alpha.

Every uptraining of the table (study.uptrainings(): MQA and GQA mean-pooled as in the paper, and
each of kvjax's conversions with distillation) at each alpha of study.fractions, with MHA-big as
the reference line. The study is the table's GqaStudy with job "gqa_figure5"; run in the table's
workdir, it reuses MHA-big and the uptrainings the table made.

Writes gqa_figure5.{md,csv,json,png}. Run: kvjax run configs/gqa_figure5/tiny.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvjax.studies.parts import gqa as gs
from kvjax.studies.base import report


def run(study: gs.GqaStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Runs every stage not done yet in `workdir` (reporting each through `progress`), writes
  gqa_figure5.{md,csv,json,png} there; returns the rows."""
  stages = gs.open_stages(study, workdir, progress)
  mha = gs.pretrain(study, stages, "big")
  rows = [
    {
      "model": "MHA-big",
      "num_kv_heads": study.big.num_heads,
      "alpha": alpha,
      "bits_per_byte": mha["bits_per_byte"],
      "accuracy": mha["accuracy"],
    }
    for alpha in study.fractions
  ]
  for conversion, distill in study.uptrainings():
    for alpha in study.fractions:
      # Distillation needs training steps: at alpha = 0 the row is the conversion alone.
      weight = distill if alpha > 0 else 0.0
      after = stages.done[gs.uptrained(study, stages, conversion, alpha, weight).name]["after"]
      rows.append(
        {
          "model": study.row_name(conversion, distill),
          "num_kv_heads": study.kv_heads_at_bytes(conversion.target(study.big)),
          "alpha": alpha,
          "bits_per_byte": after["bits_per_byte"],
          "accuracy": after["accuracy"],
        }
      )
  stem = workdir / "gqa_figure5"
  table = report.write_table(rows, stem, [(k, k, ".4f" if k in ("bits_per_byte", "accuracy") else "") for k in rows[0]])
  Path(f"{stem}.md").write_text(f"# GQA Figure 5: uptraining proportion\n\n{table}\n")
  series = [
    (name, [r["alpha"] for r in rows if r["model"] == name], [r["bits_per_byte"] for r in rows if r["model"] == name])
    for name in dict.fromkeys(r["model"] for r in rows)
  ]
  gs.plot(
    Path(f"{stem}.png"),
    series,
    "uptraining proportion alpha",
    "held-out bits per byte (better: up)",
    "Figure 5: uptraining proportion",
  )
  return rows
