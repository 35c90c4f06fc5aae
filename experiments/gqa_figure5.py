"""The GQA paper's Figure 5: quality against the uptraining proportion alpha for every uptraining
of the table (study.uptrainings(): MQA and GQA mean-pooled as in the paper, and each of kvjax's
conversions with distillation), with MHA-big as the reference line.
Writes gqa_figure5.{csv,json,png}. Run: kvjax run configs/gqa_figures/figure5_tiny.py
"""

from __future__ import annotations

from pathlib import Path

from kvjax.studies import gqa as gs
from kvjax.studies import report


def main(study: gs.GqaStudy, workdir: Path) -> list[dict]:
  stages = gs.open_stages(study, workdir)
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
  print(report.write_table(rows, stem, [(k, k, ".4f" if k in ("bits_per_byte", "accuracy") else "") for k in rows[0]]))
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
