"""Driver for job "kv_frontier" (`kvjax run configs/kv_frontier/<name>.py --workdir W`): every
variant of kvjax.studies.kv_frontier measured on one MHA-big; writes kv_frontier.{csv,json,md,png}
into W and returns the rows."""

from __future__ import annotations

from pathlib import Path

from kvjax.studies import kv_frontier as kvf
from kvjax.studies import kv_frontier_report as kvf_report
from kvjax.studies import report


def main(study: kvf.KVFrontierStudy, workdir: str | Path) -> list[dict]:
  workdir = Path(workdir)
  kvf.check_variants(study)  # before anything trains: a cache kind this kvjax lacks is one error
  rows = kvf.measure(study, kvf.prepare_sources(study, workdir))
  stem = workdir / "kv_frontier"
  report.write_table(rows, stem, kvf_report.csv_columns(study))
  text = kvf_report.report_text(study, rows)
  Path(f"{stem}.md").write_text(text)
  kvf_report.plot(study, rows, Path(f"{stem}.png"))
  print(text, flush=True)
  return rows
