"""Scoring of long-context answers, shared by the pass-key test and the RULER-style suite, and
their per-sample records as JSON lines.

score(answer, references) is RULER's `string_match_all` (Hsieh et al. 2024): the fraction of the
references that appear in the answer, case-insensitively, as substrings. A substring match, not
"the first number equals the key": a model that says "Sure! The secret passkey is 48213." has
found the key though its first words are not it, and one that stops after four of five digits
has not.

A base model (no chat template) does not end its turn: it writes its answer and goes on with
more text to the end of its budget. Its answer may end at its first line instead (answer_end
"line"; "auto" picks it for a model without a chat template): first_line cuts the text, and LineEnd
stops its decoding there. Greedy decoding is causal, so an answer stopped at its line break and
cut is the answer decoded to the budget and cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

SAMPLES = "samples.jsonl"  # the inputs of a recall measurement, one sample a line
ANSWERS = "answers.jsonl"  # its results, one (sample, method) a line
ANSWER_ENDS = ("auto", "line", "budget")


def score(answer: str, references: Sequence[str]) -> float:
  """The fraction of `references` found in `answer` (case-insensitive substrings), in [0, 1]."""
  if isinstance(references, str) or not references:
    raise ValueError(f"score: references must be a non-empty sequence of strings, got {references!r}")
  text = answer.lower()
  return sum(ref.lower() in text for ref in references) / len(references)


def answer_end(end: str, tokenizer) -> str:
  """'line' or 'budget' (module docstring): `end`, or for 'auto' 'line' when the tokenizer has no
  chat template and 'budget' (a stop id or the budget) when it has one."""
  if end not in ANSWER_ENDS:
    raise ValueError(f"answer_end must be one of {ANSWER_ENDS}, got {end!r}")
  if end == "auto":
    return "budget" if tokenizer.chat_template else "line"
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
