"""Scoring of long-context answers, shared by the pass-key test and the RULER-style suite, and
their per-sample records as JSON lines.

score(answer, references) is RULER's `string_match_all` (Hsieh et al. 2024): the fraction of the
references that appear in the answer, case-insensitively, as substrings. A substring match, not
"the first number equals the key": a model that says "Sure! The secret passkey is 48213." has
found the key though its first words are not it, and one that stops after four of five digits
has not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

SAMPLES = "samples.jsonl"  # the inputs of a recall measurement, one sample a line
ANSWERS = "answers.jsonl"  # its results, one (sample, method) a line


def score(answer: str, references: Sequence[str]) -> float:
  """The fraction of `references` found in `answer` (case-insensitive substrings), in [0, 1]."""
  if isinstance(references, str) or not references:
    raise ValueError(f"score: references must be a non-empty sequence of strings, got {references!r}")
  text = answer.lower()
  return sum(ref.lower() in text for ref in references) / len(references)


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
