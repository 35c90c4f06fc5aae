"""The gap an uptraining closes, against its steps.

A conversion opens a gap in held-out loss (nats per token) between the source model and the
converted one at alpha = 0; a recovery closes part of it:

  gap closed = (loss at alpha 0 - loss) / (loss at alpha 0 - loss of the source)

0 at the converted model, 1 at the source (above 1: better than the source on that data). The
curve of an end-to-end uptraining reads its held-out evaluations (the "eval" lines of
WORKDIR/metrics.jsonl, kvjax.training.train) and starts at step 0 with the model it started from:
a layer-local recovery's own figure when it was initialised from one (`kvjax uptrain --init`),
else the converted model's. Every loss is measured on the same held-out windows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


def gap_closed(value: float, start: float, goal: float) -> float | None:
  """The fraction of the way from `start` to `goal` that `value` went (None when they are equal)."""
  return (start - value) / (start - goal) if start != goal else None


def eval_lines(metrics: str | Path) -> list[dict]:
  """The held-out evaluations a training run logged to `metrics` (a metrics.jsonl), in step order."""
  lines = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
  return sorted((line for line in lines if line.get("kind") == "eval"), key=lambda line: line["step"])


def gap_closed_curve(converted: float, source: float, start: float, evals: Iterable[dict]) -> list[dict]:
  """[{"step", "val_loss", "gap_closed"}]: step 0 at loss `start` (the model training began from),
  then one point per eval line ({"step", "val_loss"}); the gap runs from `converted` (loss at
  alpha 0) to `source` (the source model's loss)."""
  points = [(0, start)] + [(int(e["step"]), float(e["val_loss"])) for e in evals]
  return [{"step": s, "val_loss": loss, "gap_closed": gap_closed(loss, converted, source)} for s, loss in points]
