"""Scoring of long-context answers, shared by the pass-key test and the RULER-style suite, and
their per-sample records as JSON lines.

score(answer, references) is RULER's `string_match_all` (Hsieh et al. 2024): the fraction of the
references that appear in the answer, case-insensitively, as substrings. A substring match, not
"the first number equals the key": a model that says "Sure! The secret passkey is 48213." has
found the key though its first words are not it, and one that stops after four of five digits
has not.

An answer ends at a stop id or its task's budget (answer_end "budget"), or also at its first
line break (answer_end "line": first_line cuts the text, LineEnd stops its decoding there; greedy
decoding is causal, so an answer stopped at its line break and cut is the budget's answer cut). A
base model writes on past its answer to its budget; ending it at its first line was calibrated on
Gemma 3's full cache (docs/results.md) and costs list answers that begin on the next line, so the
budget is the default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

SAMPLES = "samples.jsonl"  # the inputs of a recall measurement, one sample a line
ANSWERS = "answers.jsonl"  # its results, one (sample, method) a line
ANSWER_ENDS = ("budget", "line")


def score(answer: str, references: Sequence[str]) -> float:
  """The fraction of `references` found in `answer` (case-insensitive substrings), in [0, 1]."""
  if isinstance(references, str) or not references:
    raise ValueError(f"score: references must be a non-empty sequence of strings, got {references!r}")
  text = answer.lower()
  return sum(ref.lower() in text for ref in references) / len(references)


def check_answer_end(end: str) -> str:
  """`end` when it is one of ANSWER_ENDS, else a ValueError naming answer_end."""
  if end not in ANSWER_ENDS:
    raise ValueError(f"answer_end must be one of {ANSWER_ENDS}, got {end!r}")
  return end


def first_line(text: str) -> str:
  """`text` cut at its first line break after its first non-blank character."""
  return text.lstrip().split("\n", 1)[0]


class LineEnd:
  """The stop test of an answer that ends at its first line (kvjax.decoding.many.answer_many's
  `until`): true once the text of a row's tokens holds a line break after non-blank text."""

  def __init__(self, tokenizer):
    pieces = tokenizer.tokenizer.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=True)
    self.breaks = np.array(["\n" in p for p in pieces])  # the tokens whose text breaks a line
    self.tokenizer = tokenizer

  def __call__(self, ids: Sequence[int]) -> bool:
    return bool(self.breaks[ids[-1]]) and "\n" in self.tokenizer.decode(ids, skip_special_tokens=True).lstrip()


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
  """Write `records` to `path` as JSON lines (replacing the file) and return the path."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
  return path


def read_jsonl(path: str | Path) -> list[dict]:
  """The records of a JSON-lines file."""
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
