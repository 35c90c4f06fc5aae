"""Driver for job "real_gqa_table" (`kvjax run configs/gqa_table/smollm2.py --workdir W`): the GQA
table on a pretrained checkpoint (kvjax.studies.real_gqa); writes real_gqa_table.{csv,json,md,png}
into W and returns the rows."""

from __future__ import annotations

from pathlib import Path

from kvjax.studies.real_gqa import RealGqaStudy, run_study


def main(study: RealGqaStudy, workdir: str | Path) -> list[dict]:
  rows = run_study(study, workdir)
  print((Path(workdir) / "real_gqa_table.md").read_text(), flush=True)
  return rows
