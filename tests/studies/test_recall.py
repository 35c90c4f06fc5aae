"""The long-range recall test: the layout of its examples, its determinism, its scoring through
the cache, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.studies.suite.recall import (
  CLOSE,
  MARKER,
  SEPARATOR,
  RecallConfig,
  examples,
  recall,
  recall_checkpoint,
  score,
)
from conftest import init_params, tiny_config

FILLER = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, np.uint8)


@pytest.mark.parametrize("distance", [20, 45])
def test_the_needle_lies_exactly_distance_positions_before_the_prompt_end(distance):
  config = RecallConfig(distances=(distance,), needles=5, needle_bytes=6, seed=3)
  prompts, needles = examples(config, distance, FILLER)
  assert prompts.shape == (5, len(MARKER) + distance + 1) and needles.shape == (5, 6)
  for prompt, needle in zip(prompts, needles):
    text = prompt.astype(np.uint8).tobytes()
    last = len(text) - 1
    assert text[last - distance : last - distance + 6] == needle.astype(np.uint8).tobytes()  # D back
    assert text.startswith(MARKER) and text.endswith(SEPARATOR + MARKER) and text.count(MARKER) == 2
    filler = text[len(MARKER) + 6 + len(CLOSE) : -len(SEPARATOR + MARKER)]
    assert filler in FILLER.tobytes() and len(filler) == distance - config.min_distance
    assert needle.astype(np.uint8).tobytes().isalnum()
  again = examples(config, distance, FILLER)
  assert (again[0] == prompts).all() and (again[1] == needles).all()  # seeded
  other = examples(RecallConfig(distances=(distance,), needles=5, needle_bytes=6, seed=4), distance, FILLER)
  assert not (other[1] == needles).all()


def test_scores_are_the_greedy_copies_through_the_cache():
  model, params = init_params(tiny_config(vocab_size=256, max_len=96))
  config = RecallConfig(distances=(20, 40), needles=3, needle_bytes=5)
  first = recall(model, params, config, FILLER)
  assert recall(model, params, config, FILLER) == first
  assert list(first) == ["20", "40"]
  for result in first.values():
    assert 0 <= result["exact_match"] <= result["byte_accuracy"] <= 1 and result["needles"] == 3


def test_score_counts_bytes_in_place_and_whole_needles():
  config = RecallConfig(distances=(20,), needles=2, needle_bytes=5)
  _, needles = examples(config, 20, FILLER)
  assert score(needles, needles) == {"byte_accuracy": 1.0, "exact_match": 1.0}
  wrong = needles.copy()
  wrong[0, 2] += 1
  assert score(wrong, needles) == {"byte_accuracy": 0.9, "exact_match": 0.5}
  shifted = np.roll(needles, 1, axis=1)  # the right bytes one place off are not a copy
  assert score(shifted, needles)["exact_match"] == 0.0


def test_bad_settings_are_refused_with_the_field_named(tmp_path):
  with pytest.raises(ValueError, match=r"RecallConfig.distances\[1\]=10 is below 24"):
    RecallConfig(distances=(30, 10), needle_bytes=12)
  with pytest.raises(ValueError, match="must be distinct"):
    RecallConfig(distances=(30, 30))
  with pytest.raises(ValueError, match="non-empty tuple"):
    RecallConfig(distances=())
  with pytest.raises(ValueError, match="needs 63 positions, more than ModelConfig.max_len=60"):
    RecallConfig(distances=(40,), needle_bytes=13).check_model(60, 256)
  with pytest.raises(ValueError, match="vocab_size=64"):
    RecallConfig().check_model(1024, 64)
  with pytest.raises(ValueError, match="fewer than distance"):
    examples(RecallConfig(distances=(200,)), 200, FILLER[:50])
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(ValueError, match="tokenizer.json"):
    recall_checkpoint(tmp_path, RecallConfig())
