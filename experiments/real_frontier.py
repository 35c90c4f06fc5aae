"""Driver for job "real_frontier" (`kvjax run configs/kv_frontier/smollm2.py --workdir W`): every
variant of kvjax.studies.real_frontier measured on the pretrained model; writes
real_frontier.{csv,json,md} and real_frontier_{perplexity,recall}.png into W; returns the rows."""

from __future__ import annotations

from pathlib import Path

from kvjax.studies import report
from kvjax.studies.real_frontier import RealFrontierStudy, columns, plot, run_study


def main(study: RealFrontierStudy, workdir: str | Path) -> list[dict]:
  rows = run_study(study, workdir)
  stem = Path(workdir) / "real_frontier"
  table = report.write_table(rows, stem, columns(study))
  plot(study, rows, stem)
  text = f"# The KV frontier on {study.source}\n\n{table}\n"
  Path(f"{stem}.md").write_text(text)
  print(text, flush=True)
  return rows
