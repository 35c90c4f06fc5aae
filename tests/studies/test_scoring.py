"""RULER's scoring (the fraction of references found in the answer) and the JSON-lines records."""

from __future__ import annotations

import pytest

from kvjax.studies.scoring import read_jsonl, score, write_jsonl


def test_score_is_the_fraction_of_references_found_anywhere_in_the_answer():
  assert score("The secret passkey is 48213.", ["48213"]) == 1.0
  assert score("Version 3, then: 48213", ["48213"]) == 1.0  # not the first number, still found
  assert score("The secret passkey is 4821", ["48213"]) == 0.0  # cut before the key ends
  assert score("Apple and PEAR", ["apple", "pear", "plum", "fig"]) == 0.5  # case-insensitive
  with pytest.raises(ValueError, match="references must be a non-empty sequence"):
    score("48213", "48213")
  with pytest.raises(ValueError, match="references must be a non-empty sequence"):
    score("48213", [])


def test_records_round_trip_as_json_lines(tmp_path):
  records = [
    {"id": "passkey/512/0", "answer": "48213", "score": 1.0},
    {"id": "passkey/512/1", "answer": "", "score": 0.0},
  ]
  path = write_jsonl(tmp_path / "run" / "answers.jsonl", records)
  assert path.read_text().count("\n") == 2 and read_jsonl(path) == records
