"""The GQA paper's Table 1 and Figure 3: time per sample vs quality for MHA-small, MHA-big and
MHA-big uptrained (mean-pooled, alpha = study.fraction) into GQA and MQA.

Writes gqa_table.{md,csv,json,png} into the workdir. Run: kvjax run configs/gqa_table/tiny.py
"""

from __future__ import annotations

from pathlib import Path

from kvjax.studies import gqa as gs
from kvjax.studies import report

COLUMNS = [("model", "model", ""), ("num_kv_heads", "kv heads", "d"), ("params", "params", ","),
           ("kv_bytes_per_token", "KV bytes/token", ","), ("time_per_sample_s", "time/sample (s)", ".5f"),
           ("speedup_vs_mha_big", "speedup vs MHA-big", ".2f"), ("bits_per_byte", "val bits/byte", ".4f"),
           ("accuracy", "val accuracy", ".4f"), ("converted_bits_per_byte", "bits/byte at alpha=0", ".4f")]


def main(study: gs.GqaStudy, workdir: Path) -> list[dict]:
  stages = gs.Stages(workdir, study)
  gs.pretrain(study, stages, workdir, "small")
  gs.pretrain(study, stages, workdir, "big")
  models = [("MHA-small", study.small.num_kv_heads, workdir / "mha_small", None),
            ("MHA-big", study.big.num_kv_heads, workdir / "mha_big", None)]
  for kv in (study.gqa_kv_heads, 1):
    dest = gs.uptrained(study, stages, workdir, kv)
    models.append((study.row_name(kv), kv, dest, stages.done[dest.name]["converted"]))

  measured = gs.measure(study, stages, {name: path for name, _, path, _ in models})
  rows = [{"model": name, "num_kv_heads": kv, **measured[name],
           "converted_bits_per_byte": converted["bits_per_byte"] if converted else None}
          for name, kv, _, converted in models]
  base = next(r for r in rows if r["model"] == "MHA-big")
  for row in rows:
    row["speedup_vs_mha_big"] = base["time_per_sample_s"] / row["time_per_sample_s"]

  stem = workdir / "gqa_table"
  table = report.write_table(rows, stem, COLUMNS)
  paper = report.markdown_table([dict(zip(("model", "time", "score"), r)) for r in gs.PAPER_TABLE],
                            [("model", "paper model", ""), ("time", "time/sample (s)", ".2f"),
                             ("score", "avg score", ".1f")])
  t = study.timing
  text = (f"# GQA table (alpha = {study.fraction})\n\n{table}\n\n"
          f"Time per sample: median of {t.repeats} jitted `generate` calls, batch {t.batch}, prompt "
          f"{t.prompt}, {t.new_tokens} new tokens, divided by the batch. Quality: held-out bits per byte "
          f"(lower is better).\n\nFor reference, the paper's Table 1:\n\n{paper}\n")
  Path(f"{stem}.md").write_text(text)
  print(text)
  gs.plot(Path(f"{stem}.png"), [(r["model"], [r["time_per_sample_s"] * 1e3], [r["bits_per_byte"]]) for r in rows],
          "time per sample (ms)", "held-out bits per byte (better: up)", "kvjax: time vs quality",
          annotate=[[r["model"]] for r in rows], paper=True)
  return rows
