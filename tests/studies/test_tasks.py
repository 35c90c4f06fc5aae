"""The downstream tasks of the paper's protocol: well-formed, disjoint splits, masks on the answers,
fine-tuning that learns (by the training module's step, its loss on the mask), exact-match
scoring, determinism and refusals."""

from __future__ import annotations

import codecs
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.studies.base import tasks
from kvjax.training.step import init_state, make_optimizer, make_train_step

# seq_len 64 keeps the compiled shapes small; the data tests also run the default 128.
# One optimizer (lr, warmup) for every test: one compiled train step.
CONFIG = tasks.TaskConfig(steps=2, batch_size=8, eval_examples=8, seq_len=64, lr=3e-3, warmup_steps=2)


@pytest.fixture(scope="module")
def tiny():
  config = kvjax.ModelConfig(
    vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=128
  )
  model = kvjax.Transformer(config)
  return model, model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]


def row_bytes(examples: tasks.Examples, i: int) -> bytes:
  """Row i's full text (inputs, then the last target), padding stripped."""
  text = np.append(examples.inputs[i], examples.targets[i, -1]).astype(np.uint8).tobytes()
  return text.rstrip(b"\0")


def masked_bytes(examples: tasks.Examples, i: int) -> bytes:
  return examples.targets[i][examples.mask[i] > 0].astype(np.uint8).tobytes()


def splits(task: str, config: tasks.TaskConfig) -> list[tasks.Examples]:
  return [tasks.held_out(task, config), *tasks.train_batches(task, config)]


@pytest.mark.parametrize("seq_len", [64, 128])
def test_rot13_examples_are_source_tab_rot13_newline_with_the_loss_on_the_target(seq_len):
  config = tasks.TaskConfig(steps=3, seq_len=seq_len)
  for examples in splits("rot13", config):
    for i, (prompt, answer) in enumerate(zip(examples.prompts, examples.answers)):
      source = prompt[:-1]
      assert prompt.endswith(b"\t") and b"\t" not in source and b"\n" not in source
      assert 20 <= len(source) <= min(60, (seq_len - 1) // 2) and source.isascii()
      assert answer == codecs.encode(source.decode(), "rot13").encode() != source
      assert row_bytes(examples, i) == prompt + answer + b"\n"
      assert masked_bytes(examples, i) == answer + b"\n"


@pytest.mark.parametrize("seq_len", [64, 128])
def test_recall_answer_is_the_value_of_the_queried_key_which_appears_once(seq_len):
  config = tasks.TaskConfig(steps=3, seq_len=seq_len)
  num_pairs = tasks.recall_pairs(seq_len)
  for examples in splits("recall", config):
    for i, (prompt, answer) in enumerate(zip(examples.prompts, examples.answers)):
      context, query = prompt.decode().split(" ?")
      pairs = dict(re.fullmatch(r"([a-z]{3})=([0-9]{3})", p).groups() for p in context.split(" "))
      assert len(pairs) == num_pairs and query.endswith("=") and len(query) == 4
      key = query[:-1]
      assert context.count(key) == 1 and answer.decode() == pairs[key]
      text = prompt + answer + b"\n"
      assert row_bytes(examples, i) == text and masked_bytes(examples, i) == answer + b"\n"
      assert len(text) <= seq_len + 1 < len(text) + 8  # as many pairs as fit


def test_prose_rows_are_documentation_windows_scored_at_every_byte():
  train, held = tasks.documentation()
  for split, examples in zip((held, train), splits("prose", tasks.TaskConfig(steps=2))):
    assert examples.inputs.shape == (examples.inputs.shape[0], 128) and examples.mask.all()
    np.testing.assert_array_equal(examples.inputs[:, 1:], examples.targets[:, :-1])
    for i in range(len(examples.inputs)):
      assert np.append(examples.inputs[i], examples.targets[i, -1]).astype(np.uint8).tobytes() in split


def test_train_and_held_out_parts_are_disjoint():
  train, held = tasks.documentation()
  assert 0.15 < len(held) / (len(train) + len(held)) < 0.25
  train_paragraphs = set(tasks.paragraphs_of(train.decode()))
  held_paragraphs = tasks.paragraphs_of(held.decode())
  assert held_paragraphs and not train_paragraphs.intersection(held_paragraphs)
  for window in tasks.held_out("prose", tasks.TaskConfig()).inputs:
    assert window.astype(np.uint8).tobytes() not in train
  train_words = " ".join(tasks.split_words("train")).encode()
  for task in ("rot13", "recall"):
    config = tasks.TaskConfig(steps=20)
    held_prompts = tasks.held_out(task, config).prompts
    train_prompts = {p for batch in tasks.train_batches(task, config) for p in batch.prompts}
    assert len(set(held_prompts)) == len(held_prompts) and not train_prompts.intersection(held_prompts)
  assert not any(p[:-1] in train_words for p in tasks.held_out("rot13", tasks.TaskConfig()).prompts)


def test_exact_match_scores_true_answers_100_and_wrong_outputs_0():
  answers = tuple(tasks.held_out("rot13", CONFIG).answers)
  width = max(map(len, answers)) + 1

  def outputs(texts):  # as kvjax.generate returns them: eos (newline) after the stop
    out = np.full((len(texts), width), ord("\n"), np.int32)
    for i, text in enumerate(texts):
      text = text[:width]
      out[i, : len(text)] = np.frombuffer(text, np.uint8)
    return out

  assert tasks.exact_match(outputs([a + b"\n" for a in answers]), answers) == 100.0
  assert tasks.exact_match(outputs([a + b"\nxyz" for a in answers]), answers) == 100.0
  assert tasks.exact_match(outputs([b"x" + a[1:] for a in answers]), answers) == 0.0
  assert tasks.exact_match(outputs([a[:-1] for a in answers]), answers) == 0.0
  no_newline = outputs([a + b"a" * (width - len(a)) for a in answers])
  assert tasks.exact_match(no_newline, answers) == 0.0
  assert len(answers) == 8 and tasks.exact_match(outputs([b"?\n"] + list(answers[1:])), answers) == 87.5


def test_byte_accuracy_gives_partial_credit_in_place_and_charges_for_length():
  answers = (b"abcd", b"wxyz")

  def outputs(texts):
    out = np.full((len(texts), 8), ord("\n"), np.int32)
    for i, text in enumerate(texts):
      out[i, : len(text)] = np.frombuffer(text, np.uint8)
    return out

  assert tasks.byte_accuracy(outputs([b"abcd", b"wxyz"]), answers) == 100.0
  assert tasks.byte_accuracy(outputs([b"abXd", b"wxyz"]), answers) == 87.5  # 3/4 and 4/4
  assert tasks.byte_accuracy(outputs([b"ab", b"wxyzwxyz"]), answers) == 50.0  # 2/4 and 4/8 (no newline)
  assert tasks.byte_accuracy(outputs([b"Xabc", b""]), answers) == 0.0  # shifted bytes are not in place
  assert tasks.exact_match(outputs([b"abXd", b"wxyz"]), answers) == 50.0


def test_finetuning_reduces_the_task_loss_and_leaves_the_input_alone(tiny):
  model, params = tiny
  before = jax.tree.map(np.array, params)
  config = dataclasses.replace(CONFIG, steps=20)
  for task in ("recall", "rot13"):
    held = tasks.held_out(task, config)
    start = tasks.teacher_forced(model, params, held, config.batch_size)["loss"]
    tuned, loss = tasks.finetune(model, params, task, config)
    end = tasks.teacher_forced(model, tuned, held, config.batch_size)["loss"]
    assert end < start - 1.0 and np.isfinite(loss)  # from ln 256 = 5.5 nats: the answer's bytes
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, params), before)


def test_finetuning_steps_average_the_loss_over_the_mask_only(tiny):
  """The training module's step with a mask: all ones is the plain step; otherwise its loss is the
  teacher-forced mean over the masked targets, and targets outside the mask leave the update as it
  is, bit for bit."""
  model, params = tiny
  optimizer_config = tasks.tuning(CONFIG)
  optimizer = make_optimizer(optimizer_config)
  batch = next(tasks.train_batches("rot13", CONFIG))

  def two_steps(step, *args):
    """The params after two steps on the batch (the first has the warmup's learning rate 0), and
    the first step's loss."""
    state = init_state(model, optimizer, jax.random.key(0), jax.tree.map(jnp.copy, params))
    state, metrics = step(state, batch.inputs, *args)
    state, _ = step(state, batch.inputs, *args)
    return jax.tree.map(np.asarray, state.params), float(metrics["loss"])

  masked = tasks.tuning_step(model, optimizer_config)
  ones, ones_loss = two_steps(masked, batch.targets, np.ones_like(batch.mask))
  plain, plain_loss = two_steps(make_train_step(model, optimizer), batch.targets)
  assert ones_loss == pytest.approx(plain_loss, rel=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), ones, plain)
  tuned, loss = two_steps(masked, batch.targets, batch.mask)
  assert 0 < batch.mask.sum() < batch.mask.size / 2  # the answers: a minority of the targets
  want = tasks.teacher_forced(model, params, dataclasses.replace(batch, prompts=(), answers=()), CONFIG.batch_size)
  assert loss == pytest.approx(want["loss"], rel=1e-5)
  unscored = np.where(batch.mask > 0, batch.targets, (batch.targets + 1) % 256)
  jax.tree.map(np.testing.assert_array_equal, two_steps(masked, unscored, batch.mask)[0], tuned)
  assert np.abs(tuned["layers_0"]["attn"]["q"]["kernel"] - ones["layers_0"]["attn"]["q"]["kernel"]).max() > 1e-6


def test_score_all_is_deterministic_and_averages_the_tasks(tiny):
  model, params = tiny
  first = tasks.score_all(model, params, CONFIG)
  assert list(first) == list(tasks.TASKS)
  for task, result in first.items():
    assert result["task"] == task and result["steps"] == 2 and np.isfinite(result["loss"])
    assert 0.0 <= result["score"] <= 100.0 and result["eval_loss"] > 0
  assert first["rot13"]["exact_match"] == first["recall"]["exact_match"] == 0.0  # a near-random model
  assert first["rot13"]["score"] < 50 and first["recall"]["score"] < 50
  assert tasks.score_all(model, params, CONFIG) == first
  other = tasks.finetune_and_score(model, params, "prose", dataclasses.replace(CONFIG, seed=1))
  assert other["loss"] != first["prose"]["loss"]
  assert tasks.average_score(first) == pytest.approx(sum(r["score"] for r in first.values()) / 3)
  untuned = tasks.finetune_and_score(model, params, "prose", dataclasses.replace(CONFIG, steps=0))
  assert untuned["loss"] is None and untuned["eval_loss"] > first["prose"]["eval_loss"]


def test_bad_input_is_refused_naming_the_field(tiny):
  model, params = tiny
  with pytest.raises(ValueError, match="unknown task 'summary'; the tasks are prose, rot13, recall"):
    tasks.finetune_and_score(model, params, "summary", CONFIG)
  with pytest.raises(ValueError, match="TaskConfig.tasks: unknown task 'bleu'"):
    tasks.TaskConfig(tasks=("prose", "bleu"))
  for field, value in [
    ("steps", -1),
    ("batch_size", 0),
    ("lr", 0.0),
    ("seq_len", 32),
    ("eval_examples", 0),
    ("tasks", ()),
    ("tasks", ("prose", "prose")),
    ("tasks", ["prose"]),
  ]:
    with pytest.raises(ValueError, match=f"TaskConfig.{field}"):
      tasks.TaskConfig(**{field: value})
  small_vocab = kvjax.Transformer(model.config.replace(vocab_size=64))
  with pytest.raises(ValueError, match="ModelConfig.vocab_size=64"):
    tasks.finetune_and_score(small_vocab, params, "prose", CONFIG)
  short = kvjax.Transformer(model.config.replace(max_len=32))
  with pytest.raises(ValueError, match="ModelConfig.max_len=32 is below TaskConfig.seq_len=64"):
    tasks.score_all(short, params, CONFIG)
