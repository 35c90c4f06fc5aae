"""The GQA paper's Figure 6: time per sample against the number of kv heads.

Every divisor of MHA-big's head count, from MQA to MHA. Timing does not depend on the weights'
values, so the mean-pooled conversions are timed without uptraining. The study is the table's
GqaStudy with job "gqa_figure6"; run in the table's workdir, it reuses MHA-big.

Writes gqa_figure6.{md,csv,json,png}. Run: kvjax run configs/gqa_figure6/tiny.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvjax.cache import kinds
from kvjax.conversion.conversions import KVHeads
from kvjax.model.transformer import Transformer
from kvjax.studies.parts import gqa as gs
from kvjax.studies.base import report
from kvjax.studies.base.stages import time_per_sample
from kvjax.training import checkpoint


def run(study: gs.GqaStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Runs every stage not done yet in `workdir` (reporting each through `progress`), writes
  gqa_figure6.{md,csv,json,png} there; returns the rows."""
  stages = gs.open_stages(study, workdir, progress)
  gs.pretrain(study, stages, "big")
  model, params, _ = checkpoint.load_model(workdir / "mha_big")
  heads = study.big.num_heads
  models = {f"kv{kv}": KVHeads(kv).convert(params, model.config) for kv in range(1, heads + 1) if heads % kv == 0}
  timing = stages.run(
    "timing_kv_sweep",
    lambda: time_per_sample(
      {name: (Transformer(config), converted) for name, (converted, config) in models.items()}, study.timing
    ),
  )
  rows = [
    {
      "num_kv_heads": config.num_kv_heads,
      "time_per_sample_s": timing[name]["time_per_sample_s"],
      "kv_bytes_per_token": kinds.bytes_per_token(config),
    }
    for name, (_, config) in models.items()
  ]
  stem = workdir / "gqa_figure6"
  table = report.write_table(
    rows,
    stem,
    [
      ("num_kv_heads", "kv heads", "d"),
      ("time_per_sample_s", "time/sample (s)", ".6f"),
      ("kv_bytes_per_token", "KV bytes/token", ","),
    ],
  )
  Path(f"{stem}.md").write_text(f"# GQA Figure 6: kv heads vs time\n\n{table}\n")
  gs.plot(
    Path(f"{stem}.png"),
    [("time per sample", [r["num_kv_heads"] for r in rows], [r["time_per_sample_s"] * 1e3 for r in rows])],
    "kv heads (1 = MQA, %d = MHA)" % heads,
    "time per sample (ms)",
    "Figure 6: kv heads vs time",
    lower_is_better=False,
  )
  return rows
