"""The GQA paper's Table 1 and Figure 3: time per sample vs quality, MHA to GQA, MQA and MLA.

Rows: MHA-small, MHA-big, MHA-big uptrained into GQA and MQA as the paper does (mean-pooled,
alpha = study.fraction), and MHA-big uptrained by each of kvjax's conversions
(study.conversions: data-aware regrouping, multi-head latent attention, ...) with distillation
(study.distill), all timed together. Quality is measured both ways: held-out bits per byte right
after (up)training, and the paper's protocol, every model fine-tuned on each downstream task and
scored there (kvjax.studies.base.tasks). The study is a GqaStudy (kvjax.studies.parts.gqa) with job
"gqa_table".

Writes gqa_table.{md,csv,json,png} into the workdir. Run: kvjax run configs/gqa_table/tiny.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvjax.studies.parts import gqa as gs
from kvjax.studies.base import report

COLUMNS = [
  ("model", "model", ""),
  ("num_kv_heads", "kv heads", "g"),
  ("params", "params", ","),
  ("kv_bytes_per_token", "KV bytes/token", ","),
  ("time_per_sample_s", "time/sample (s)", ".5f"),
  ("speedup_vs_mha_big", "speedup vs MHA-big", ".2f"),
  ("bits_per_byte", "val bits/byte", ".4f"),
  ("gap_closed_bits", "gap closed (bits)", ".0%"),
  ("converted_bits_per_byte", "bits/byte at alpha=0", ".4f"),
  ("prose", "prose", ".1f"),
  ("rot13", "rot13", ".1f"),
  ("recall", "recall", ".1f"),
  ("avg_score", "avg score", ".2f"),
  ("gap_closed_score", "gap closed (score)", ".0%"),
]


def gap_closed(row: dict, small: dict, big: dict, key: str) -> float | None:
  """(row - MHA-small) / (MHA-big - MHA-small) on one metric: 100% is as good as MHA-big, 0% as MHA-small."""
  if row.get(key) is None or big[key] == small[key]:
    return None
  return (row[key] - small[key]) / (big[key] - small[key])


def run(study: gs.GqaStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Runs every stage not done yet in `workdir` (reporting each through `progress`), writes
  gqa_table.{md,csv,json,png} there; returns the rows."""
  stages = gs.open_stages(study, workdir, progress)
  gs.pretrain(study, stages, "small")
  gs.pretrain(study, stages, "big")
  # (name, kv heads or their bytes, workdir, quality right after conversion or None, model config)
  models = [
    ("MHA-small", study.small.num_kv_heads, workdir / "mha_small", None, study.small),
    ("MHA-big", study.big.num_kv_heads, workdir / "mha_big", None, study.big),
  ]
  for conversion, distill in study.uptrainings():
    dest = gs.uptrained(study, stages, conversion, distill=distill)
    target = conversion.target(study.big)
    models.append(
      (
        study.row_name(conversion, distill),
        study.kv_heads_at_bytes(target),
        dest,
        stages.done[dest.name]["converted"],
        target,
      )
    )
  # A model of the architecture of one above (pca's GQA-2 beside mean's) is timed by that one.
  timed_as, first_of = {}, {}
  for name, _, _, _, config in models:
    timed_as[name] = first_of.setdefault(config, name)

  paths = {name: path for name, _, path, _, _ in models}
  measured = gs.measure(study, stages, {name: path for name, path in paths.items() if timed_as[name] == name})
  shared = [name for name in paths if timed_as[name] != name]
  quality = gs.measure_quality(study, stages, {name: paths[name] for name in shared})
  for name in shared:
    timed = {k: measured[timed_as[name]][k] for k in ("time_per_sample_s", "times_s", "kv_bytes_per_token", "params")}
    measured[name] = {**timed, **quality[name]}
  scores = gs.task_scores(study, stages, paths)
  rows = [
    {
      "model": name,
      "num_kv_heads": kv,
      **measured[name],
      **scores[name],
      "converted_bits_per_byte": converted["bits_per_byte"] if converted else None,
    }
    for name, kv, _, converted, _ in models
  ]
  small, big = rows[0], rows[1]
  for row in rows:
    row["speedup_vs_mha_big"] = big["time_per_sample_s"] / row["time_per_sample_s"]
    row["gap_closed_bits"] = gap_closed(row, small, big, "bits_per_byte")
    row["gap_closed_score"] = gap_closed(row, small, big, "avg_score")

  stem = workdir / "gqa_table"
  table = report.write_table(rows, stem, COLUMNS)
  paper = report.markdown_table(
    [dict(zip(("model", "time", "score"), r)) for r in gs.PAPER_TABLE],
    [("model", "paper model", ""), ("time", "time/sample (s)", ".2f"), ("score", "avg score", ".1f")],
  )
  t, ft = study.timing, study.tasks
  kvjax_rows = ", ".join(study.row_name(c, study.distill) for c in study.conversions)
  text = (
    f"# GQA table (alpha = {study.fraction})\n\n{table}\n\n"
    f"- time/sample: median of {t.repeats} jitted `generate` calls, batch {t.batch}, prompt {t.prompt}, "
    f"{t.new_tokens} new tokens, divided by the batch; a row with the architecture of a row above it "
    "shares that row's timing.\n"
    "- val bits/byte: held-out bits per byte of the pre-training corpus right after (up)training, no "
    "task fine-tuning (lower is better); bits/byte at alpha=0: right after conversion.\n"
    f"- GQA / MQA rows: MHA-big converted by the paper's mean-pooling, then uptrained for alpha = "
    f"{study.fraction} of MHA-big's pre-training steps.\n"
    f"- {kvjax_rows}: MHA-big converted by kvjax's conversions (in parentheses: the kv-head method, "
    "or for MLA the latent rank + rotary dims, calibrated on the training data), uptrained alike"
    + (f", with distillation weight {study.distill} towards MHA-big" if study.distill else "")
    + "; an MLA row's kv heads are those whose KV bytes per token it matches.\n"
    + f"- prose, rot13, recall, avg score: the paper's protocol. Every model is fine-tuned for {ft.steps} "
    f"steps (batch {ft.batch_size}, lr {ft.lr}) on each task and scored on its held-out split: prose "
    "next-byte accuracy (%) on Python's documentation text (held out of pre-training); rot13 "
    "(prose to ROT13) and key-value recall: byte accuracy (%) of the greedy output through the KV "
    "cache, the answer's bytes reproduced in place over the longer of output and answer (partial "
    "credit, as the paper's BLEU / ROUGE / F1; exact match in gqa_table.json); avg score is their "
    "mean.\n"
    "- gap closed: (row - MHA-small) / (MHA-big - MHA-small) on that metric: 100% is as good as "
    "MHA-big, 0% as MHA-small.\n\nFor reference, the paper's Table 1 (avg score over 7 fine-tuned "
    f"tasks):\n\n{paper}\n"
  )
  Path(f"{stem}.md").write_text(text)
  gs.plot(
    Path(f"{stem}.png"),
    [(r["model"], [r["time_per_sample_s"] * 1e3], [r["bits_per_byte"]]) for r in rows],
    "time per sample (ms)",
    "held-out bits per byte (better: up)",
    "kvjax: time vs quality",
    annotate=[[r["model"]] for r in rows],
    paper=True,
  )
  return rows
