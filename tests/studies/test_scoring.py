"""RULER's scoring (the fraction of references found in the answer), where a base model's answer
ends (its first line: the cut and the stop test on Gemma 3's real tokenizer), and the JSON-lines
records."""

from __future__ import annotations

import pytest

from kvjax.studies.base.scoring import LineEnd, check_answer_end, first_line, read_jsonl, score, write_jsonl


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


def test_a_base_models_answer_ends_at_its_first_line(gemma3_tokenizer):
  assert first_line("\n\n 8675309.\nThe special magic number for x is 1") == "8675309."
  assert first_line("no break") == "no break" and first_line("") == ""
  assert check_answer_end("line") == "line"
  with pytest.raises(ValueError, match="answer_end must be one of"):
    check_answer_end("eos")
  ends = LineEnd(gemma3_tokenizer)
  text = "\n 8675309, 1234567.\n\nThe special magic numbers for y are"
  ids = gemma3_tokenizer.encode(text).tolist()
  stopped = next(k for k in range(1, len(ids) + 1) if ends(ids[:k]))  # the leading break does not end it
  head = gemma3_tokenizer.decode(ids[:stopped])
  assert "\n" in head.lstrip() and "\n" not in gemma3_tokenizer.decode(ids[: stopped - 1]).lstrip()
  assert first_line(head) == first_line(text) == "8675309, 1234567."
