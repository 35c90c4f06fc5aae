"""The RULER-style suite (kvjax.studies.ruler, kvjax.studies.suite.ruler_tasks) on SmolLM2's tokenizer:
exact lengths, determinism, the needles where the task puts them, RULER's scoring, the templates
and the refusals; answers through a tiny random model under both protocols."""

from __future__ import annotations

import collections
import re

import pytest

from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies.suite import ruler_answers
from kvjax.studies.base.measure import PROTOCOLS
from kvjax.studies.suite.ruler_prompts import TooShort
from kvjax.studies.suite.ruler_tasks import TASKS, make_sample
from kvjax.studies.base.scoring import score
from conftest import init_params, tiny_config


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> TextTokenizer:
  return TextTokenizer.load(smollm2)


def text(tokenizer, s: dict) -> tuple[str, str]:
  return tokenizer.decode(s["context_ids"]), tokenizer.decode(s["question_ids"])


@pytest.mark.parametrize("template", ["chat", "base"])
def test_every_task_is_exactly_length_tokens(tokenizer, template):
  for task in TASKS:
    for length, index in ((1024, 0), (1024, 1), (2048, 2), (1337, 3)):
      s = make_sample(tokenizer, task, length, index, template=template)
      assert len(s["context_ids"]) + len(s["question_ids"]) == length, (task, length)
      assert s["id"] == f"{task}/{length}/{index}" and s["task"] == task and s["length"] == length
      answer = tokenizer.encode(" " + ", ".join(s["references"]))
      assert s["answer_tokens"] >= max(2 * len(answer), 30)


def test_a_seed_fixes_the_samples(tokenizer):
  for task in ("niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"):
    first = make_sample(tokenizer, task, 1024, 5, seed=3)
    assert make_sample(tokenizer, task, 1024, 5, seed=3) == first
    assert make_sample(tokenizer, task, 1024, 5, seed=4)["context_ids"] != first["context_ids"]
    assert make_sample(tokenizer, task, 1024, 6, seed=3)["context_ids"] != first["context_ids"]


NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_the_needles_hold_the_references_and_the_distractors_do_not(tokenizer, task):
  for index in range(3):
    s = make_sample(tokenizer, task, 1024, index)
    context, question = text(tokenizer, s)
    planted = NEEDLE.findall(context)
    asked = [k for k, v in planted if v in s["references"]]
    assert sorted(v for _, v in planted if v in s["references"]) == sorted(s["references"])
    assert all(key in question for key in asked)
    distractors = [(k, v) for k, v in planted if v not in s["references"]]
    assert not any(k in asked for k, _ in distractors)
    expected = {"niah_multikey_1": 3, "niah_multiquery": 0, "niah_multivalue": 0}.get(task, 0)
    if task in ("niah_multikey_2", "niah_multikey_3"):
      assert len(distractors) > 5  # the haystack is needles
    else:
      assert len(distractors) == expected
    # The needle of the first reference starts `distance` tokens before the prompt's end.
    prompt = s["context_ids"] + s["question_ids"]
    start = tokenizer.decode(prompt[len(prompt) - s["distance"] :]).lstrip()
    assert start.startswith("One of the special magic") and s["references"][0] in start.split("\n")[0]
    assert s["depth"] == pytest.approx(1 - s["distance"] / len(prompt), abs=1e-4)


def test_variable_tracking_plants_the_chain_in_order(tokenizer):
  s = make_sample(tokenizer, "vt", 1024, 0)
  context, question = text(tokenizer, s)
  body = context.split("assigned the value")[-1]  # after the worked example's answer
  lines = re.findall(r"VAR (\w+) = (?:VAR )?(\w+)", body)
  assert [name for name, _ in lines] == s["references"]
  assert lines[0][1] in question and [v for _, v in lines[1:]] == s["references"][:-1]


def test_common_and_frequent_words_are_the_most_frequent(tokenizer):
  s = make_sample(tokenizer, "cwe", 1024, 0)
  listed = text(tokenizer, s)[0].split("most often.\n")[-1]
  counts = collections.Counter(re.findall(r"\d+\. ([a-z]+)", listed))
  assert all(counts[w] == 6 for w in s["references"]) and len(s["references"]) == 10
  assert max(c for w, c in counts.items() if w not in s["references"]) == 1
  s = make_sample(tokenizer, "fwe", 2048, 0)
  counts = collections.Counter(text(tokenizer, s)[0].split("coded words. ")[-1].split())
  ranked = [w for w, _ in counts.most_common() if w != "..."]
  assert ranked[:3] == s["references"] and counts[ranked[2]] > counts[ranked[3]]


def test_chat_and_base_templates(tokenizer):
  chat = make_sample(tokenizer, "niah_single_1", 512, 0, template="chat")
  base = make_sample(tokenizer, "niah_single_1", 512, 0, template="base")
  assert make_sample(tokenizer, "niah_single_1", 512, 0) == chat  # SmolLM2 has a chat template
  (key,) = re.findall(r"for (\S+) mentioned", text(tokenizer, chat)[1])[:1]
  prefix = f"The special magic number for {key} mentioned in the provided text is"
  assert text(tokenizer, chat)[0].startswith("<|im_start|>system")
  assert text(tokenizer, chat)[1].endswith(f"<|im_end|>\n<|im_start|>assistant\n{prefix}")
  assert text(tokenizer, base)[0].startswith("A special magic number is hidden within the following text.")
  assert (
    text(tokenizer, base)[1] == f"\nWhat is the special magic number for {key} mentioned in the provided text? {prefix}"
  )


def test_scoring_counts_the_references_found():
  assert score("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
  assert score(" ALDIS, sbrdl", ["aldis", "SBRDL"]) == 1.0
  assert score("", ["1"]) == 0.0
  rows = [
    {"task": "vt", "length": 512, "score": 1.0},
    {"task": "vt", "length": 512, "score": 0.5},
    {"task": "cwe", "length": 512, "score": 0.0},
    {"task": "vt", "length": 1024, "score": 0.25},
  ]
  assert ruler_answers.summary(rows) == {
    "tasks": {"512": {"vt": 75.0, "cwe": 0.0}, "1024": {"vt": 25.0}},
    "lengths": {"512": 37.5, "1024": 25.0},
    "overall": pytest.approx(100 / 3, abs=0.01),
  }


def test_mistakes_are_refused_by_name(tokenizer):
  with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
    ruler_answers.build(tokenizer, ["niah_single_1", "niah_single_9"], [1024], 1)
  with pytest.raises(TooShort, match=r"RULER task vt: length 200 is too short .*\(at least \d+ tokens"):
    make_sample(tokenizer, "vt", 200, 0)
  with pytest.raises(TooShort, match="RULER task niah_multikey_1: length 100 is too short"):
    make_sample(tokenizer, "niah_multikey_1", 100, 0)
  with pytest.raises(ValueError, match="RULER length 9000 is more than the model's max_len=8192"):
    ruler_answers.build(tokenizer, ["niah_single_1"], [1024, 9000], 1, max_len=8192)
  with pytest.raises(ValueError, match="need 1152 positions, more than the model's max_len=1100"):
    ruler_answers.build(tokenizer, ["niah_single_1"], [1024], 1, max_len=1100)
  with pytest.raises(ValueError, match="template must be one of"):
    ruler_answers.build(tokenizer, ["vt"], [1024], 1, template="instruct")


def test_both_protocols_give_the_full_cache_s_answers(tokenizer):
  """A random tiny model over SmolLM2's vocabulary: prefilling the context then reading the
  question (query-agnostic) decodes what one generate over the whole prompt does, and every
  result is scored against its sample's references."""
  model, params = init_params(tiny_config(vocab_size=tokenizer.vocab_size, max_len=300, positions="rope"))
  samples = [dict(s, answer_tokens=6) for s in ruler_answers.build(tokenizer, ["niah_single_1"], [256], 4)[2:]]
  assert len({len(s["question_ids"]) for s in samples}) == 2  # contexts and questions of two lengths
  found = {p: ruler_answers.answer(model, params, tokenizer, samples, protocol=p, batch_size=2) for p in PROTOCOLS}
  assert [r["answer"] for r in found["query_agnostic"]] == [r["answer"] for r in found["query_aware"]]
  for s, r in zip(samples, found["query_agnostic"]):
    assert r["id"] == s["id"] and r["method"] == "full"
    assert r["score"] == score(r["answer"], s["references"])
    assert (r["depth"], r["distance"]) == (s["depth"], s["distance"])
