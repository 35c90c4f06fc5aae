"""kvpress's answers beside the presses table's (kvjax.studies.press_table), sample by sample:
kvpress's answer ids, written by experiments/kvpress_reference.py for the same token ids, decoded
by kvjax's tokenizer and scored by kvjax's scorer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvjax.studies.base.scoring import read_jsonl, score
from kvjax.studies.suite.ruler_answers import answer_text


def agreement(tokenizer, samples: list[dict], ours: list[dict], theirs: Path, end: str = "budget") -> dict[tuple, dict]:
  """{(method, protocol, length): {"same_score": the share of samples where kvpress's answer (file
  `theirs`) scores as kvjax's does, "same_answer": the share where the two answers are the same
  text}}, over the samples both answered; kvpress's ids are decoded and scored by kvjax's
  tokenizer and scorer."""
  if not theirs.exists():
    return {}
  by_id = {s["id"]: s for s in samples}
  peer = {}
  for row in read_jsonl(theirs):
    s = by_id.get(row["id"])
    if s is None:
      continue
    text = answer_text(tokenizer, row["answer_ids"], s["answer_tokens"], end)
    peer[(row["id"], row["method"], row["protocol"])] = (text, score(text, s["references"]))
  pairs: dict[tuple, list[tuple[bool, bool]]] = {}
  for r in ours:
    key = (r["id"], r["method"], r["protocol"])
    if key in peer:
      text, value = peer[key]
      pairs.setdefault((r["method"], r["protocol"], r["length"]), []).append((value == r["score"], text == r["answer"]))
  return {
    k: {
      "same_score": float(np.mean([a for a, _ in v])),
      "same_answer": float(np.mean([b for _, b in v])),
      "samples": len(v),
    }
    for k, v in pairs.items()
  }
