"""The GQA paper's protocol: fine-tune every model on each downstream task, then score it there.

Every number in the paper's Table 1 is measured after fine-tuning each model on each task, the
same fine-tuning for every row. Here the tasks are byte-level (vocabulary >= 256; one token is
one byte) and built from text every machine has offline that pre-training does not see: Python's
own documentation, `pydoc_data.topics.topics` (the pre-training corpus leaves pydoc_data out).

- "prose": language modelling of that documentation. Score: held-out next-byte accuracy (%).
- "rot13": source + b"\\t" + ROT13(source) + b"\\n", the source a 20-60 byte prose snippet. The
  output must be read off the source, so the task leans on attention over the prompt. Score:
  byte accuracy (%) of the greedy output decoded through the KV cache (kvjax.generate): the
  answer's bytes it reproduces in place, over the longer of the two, a partial credit as the
  paper's BLEU, ROUGE and F1 give; exact match (%) is reported beside it.
- "recall": N random pairs b"kqz=381 abf=920 ... ?abf=" then the value b"920\\n", N as many as
  fit seq_len. Recalling one value from many in context is where KV capacity shows. Scores as
  for rot13.

The documentation is split as kvjax.training.data.documentation splits it (every fifth block of
whole paragraphs held out), so both parts cover all topics. rot13 draws train sources from the train
part and held-out sources from the held-out part (dropping any that occur in the train part);
recall draws train and held-out pairs from different seeded streams. rot13 and recall train with
the loss on the answer and its newline only. An example is right-padded to seq_len + 1 bytes and
shifted by one into inputs and targets int32 [B, T], T = seq_len, with a float32 [B, T] loss mask,
so one jitted train step (kvjax.training.step's, given that mask) serves every task and every
step. The data depend only on the task and TaskConfig, never on the model: every row of a table
gets the same fine-tuning.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import math
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.fields import check_nonnegative, check_positive, check_real
from kvjax.decoding.decode import generate
from kvjax.model.transformer import Transformer
from kvjax.training.step import init_state, make_optimizer, make_train_step
from kvjax.training.config import TrainConfig
from kvjax.training.data import documentation, paragraphs_of

TASKS = ("prose", "rot13", "recall")
MIN_SEQ_LEN = 64  # rot13 sources of 20 bytes and recall with a handful of pairs need this much
ROT13_SOURCE_BYTES = (20, 60)
NEWLINE = ord("\n")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The fine-tuning every model gets on each task, and how many held-out examples score it.

  Pre-training's AdamW at `lr`, warmed up linearly over warmup_steps, then constant (`tuning`).
  steps = 0 scores the model as it is. `seed` fixes the training data order and the held-out
  examples.
  """

  steps: int = 100
  batch_size: int = 16
  lr: float = 1e-3
  warmup_steps: int = 10
  seq_len: int = 128
  eval_examples: int = 64
  seed: int = 0
  tasks: tuple[str, ...] = TASKS

  def __post_init__(self):
    check_nonnegative(self, "steps", "warmup_steps", "seed")
    check_positive(self, "batch_size", "seq_len", "eval_examples")
    check_real(self, "lr", 0.0, 1.0, open_low=True)
    if self.seq_len < MIN_SEQ_LEN:
      raise ValueError(f"TaskConfig.seq_len must be at least {MIN_SEQ_LEN}, got {self.seq_len!r}")
    if not isinstance(self.tasks, tuple) or not self.tasks or len(set(self.tasks)) != len(self.tasks):
      raise ValueError(
        f"TaskConfig.tasks must be a non-empty tuple of distinct task names from {TASKS}, got {self.tasks!r}"
      )
    for task in self.tasks:
      check_task(task, "TaskConfig.tasks")


def check_task(task, name: str = "task") -> None:
  if task not in TASKS:
    raise ValueError(f"{name}: unknown task {task!r}; the tasks are {', '.join(TASKS)}")


def check_model(model: Transformer, config: TaskConfig) -> None:
  """Refuses a model whose vocabulary does not hold the bytes or whose positions do not hold seq_len."""
  if model.config.vocab_size < 256:
    raise ValueError(
      f"ModelConfig.vocab_size={model.config.vocab_size}: the tasks are byte-level and "
      "need a vocabulary of at least 256"
    )
  if model.config.max_len < config.seq_len:
    raise ValueError(f"ModelConfig.max_len={model.config.max_len} is below TaskConfig.seq_len={config.seq_len}")


# The data.


@dataclasses.dataclass(frozen=True)
class Examples:
  """Rows for teacher-forced training and evaluation, and for the generated tasks what the model is
  prompted with and must produce before its newline (empty for prose)."""

  inputs: np.ndarray  # int32 [n, T]
  targets: np.ndarray  # int32 [n, T]
  mask: np.ndarray  # float32 [n, T]: 1 where a target is scored
  prompts: tuple[bytes, ...] = ()
  answers: tuple[bytes, ...] = ()


def prose_words(text: bytes) -> list[str]:
  """The words of the plain-prose paragraphs of `text` (ASCII, no indented code or grammar, no
  headings), each at most ROT13_SOURCE_BYTES[0] bytes."""
  words = []
  for paragraph in paragraphs_of(text.decode()):
    lines = paragraph.splitlines()
    if (
      not paragraph.isascii()
      or any(line[:1].isspace() for line in lines)
      or any(set(line) <= set("=*-") for line in lines)
    ):
      continue
    words += [w for w in paragraph.split() if len(w) <= ROT13_SOURCE_BYTES[0]]
  return words


def rot13(source: bytes) -> bytes:
  """ASCII letters rotated by 13; every other byte as it is."""
  return codecs.encode(source.decode("ascii"), "rot13").encode("ascii")


def rot13_longest(seq_len: int) -> int:
  """The longest rot13 source in bytes: prompt, answer and newline fit seq_len + 1."""
  return min(ROT13_SOURCE_BYTES[1], (seq_len - 1) // 2)


@functools.cache
def split_words(split: str) -> tuple[str, ...]:
  """prose_words of the documentation's "train" or "held_out" part."""
  return tuple(prose_words(documentation()[split == "held_out"]))


def rot13_source(words: tuple[str, ...], rng: np.random.Generator, longest: int) -> bytes:
  """Consecutive words from a random start, as many as fit a random length in [20, longest]."""
  while True:
    start, budget = int(rng.integers(len(words))), int(rng.integers(ROT13_SOURCE_BYTES[0], longest + 1))
    source, end = words[start], start + 1
    while end < len(words) and len(source) + 1 + len(words[end]) <= budget:
      source, end = source + " " + words[end], end + 1
    if len(source) >= ROT13_SOURCE_BYTES[0]:
      return source.encode("ascii")


def recall_pairs(seq_len: int) -> int:
  """N: the most pairs b"abc=123 " whose example (8N - 1 bytes, b" ?abc=", b"123\\n") fits seq_len + 1."""
  return (seq_len - 8) // 8


def recall_example(rng: np.random.Generator, num_pairs: int) -> tuple[bytes, bytes]:
  """(prompt, answer): num_pairs pairs of distinct 3-letter keys and 3-digit values, then a query
  for one of the keys; the answer is its value."""
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
  keys = []
  while len(keys) < num_pairs:
    key = letters[rng.integers(26, size=3)].tobytes()
    if key not in keys:
      keys.append(key)
  values = [b"%03d" % v for v in rng.integers(1000, size=num_pairs)]
  query = int(rng.integers(num_pairs))
  context = b" ".join(k + b"=" + v for k, v in zip(keys, values))
  return context + b" ?" + keys[query] + b"=", values[query]


def rows(texts: list[bytes], seq_len: int, answer_from: list[int]) -> Examples:
  """Texts of at most seq_len + 1 bytes right-padded with 0 and shifted into inputs and targets;
  the mask covers targets text[answer_from:] (0 scores every byte after the first)."""
  n = len(texts)
  padded = np.zeros((n, seq_len + 1), np.int32)
  mask = np.zeros((n, seq_len), np.float32)
  for i, (text, start) in enumerate(zip(texts, answer_from)):
    if len(text) > seq_len + 1:
      raise ValueError(f"an example of {len(text)} bytes does not fit seq_len + 1 = {seq_len + 1}")
    padded[i, : len(text)] = np.frombuffer(text, np.uint8)
    mask[i, max(start, 1) - 1 : len(text) - 1] = 1.0
  padded.flags.writeable = mask.flags.writeable = False  # held-out sets are cached and shared
  return Examples(inputs=padded[:, :-1], targets=padded[:, 1:], mask=mask)


def pair_rows(pairs: list[tuple[bytes, bytes]], seq_len: int) -> Examples:
  """Examples prompt + answer + b"\\n", the loss on the answer and its newline."""
  examples = rows([p + a + b"\n" for p, a in pairs], seq_len, [len(p) for p, _ in pairs])
  return dataclasses.replace(examples, prompts=tuple(p for p, _ in pairs), answers=tuple(a for _, a in pairs))


def task_rng(config: TaskConfig, task: str, split: str) -> np.random.Generator:
  return np.random.default_rng([config.seed, TASKS.index(task), ("train", "held_out").index(split)])


def sample(task: str, config: TaskConfig, count: int, rng: np.random.Generator, split: str) -> Examples:
  """`count` random examples of `task` from one split."""
  text = documentation()[split == "held_out"]
  if task == "prose":
    starts = rng.integers(len(text) - config.seq_len, size=count)
    return rows([text[s : s + config.seq_len + 1] for s in starts], config.seq_len, [0] * count)
  if task == "rot13":
    words, longest = split_words(split), rot13_longest(config.seq_len)
    sources = [rot13_source(words, rng, longest) for _ in range(count)]
    return pair_rows([(s + b"\t", rot13(s)) for s in sources], config.seq_len)
  num_pairs = recall_pairs(config.seq_len)
  return pair_rows([recall_example(rng, num_pairs) for _ in range(count)], config.seq_len)


def train_batches(task: str, config: TaskConfig) -> Iterator[Examples]:
  """The config.steps training batches of `task` (batch_size rows each), in order."""
  check_task(task)
  rng = task_rng(config, task, "train")
  for _ in range(config.steps):
    yield sample(task, config, config.batch_size, rng, "train")


@functools.lru_cache(maxsize=16)
def held_out(task: str, config: TaskConfig) -> Examples:
  """The config.eval_examples held-out examples of `task`: prose windows spread evenly over the
  held-out part; rot13 sources from it that occur nowhere in the train part, each once; recall
  examples from their own stream."""
  check_task(task)
  text = documentation()[1]
  n = config.eval_examples
  if task == "prose":
    starts = np.linspace(0, len(text) - config.seq_len - 1, n).astype(np.int64)
    return rows([text[s : s + config.seq_len + 1] for s in starts], config.seq_len, [0] * n)
  rng = task_rng(config, task, "held_out")
  if task == "recall":
    return sample(task, config, n, rng, "held_out")
  words, longest = split_words("held_out"), rot13_longest(config.seq_len)
  train_sources = " ".join(split_words("train")).encode()
  sources = []
  for _ in range(1000 * n):
    source = rot13_source(words, rng, longest)
    if source not in sources and source not in train_sources:
      sources.append(source)
      if len(sources) == n:
        return pair_rows([(s + b"\t", rot13(s)) for s in sources], config.seq_len)
  raise ValueError(
    f"TaskConfig.eval_examples={n}: the held-out documentation has only {len(sources)} distinct rot13 sources"
  )


# Fine-tuning and scoring.


def masked_loss(model: Transformer, params, inputs, targets, mask):
  """-> (per-token cross entropy float32 [B, T], argmax hits bool [B, T])."""
  logits = model.apply({"params": params}, inputs)  # [B, T, V]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return loss * mask, (logits.argmax(-1) == targets) & (mask > 0)


def tuning(config: TaskConfig) -> TrainConfig:
  """The optimizer settings of fine-tuning: pre-training's AdamW (kvjax.training.config.TrainConfig)
  at config.lr, warmed up over config.warmup_steps, then constant (min_lr_ratio 1)."""
  return TrainConfig(steps=config.steps, lr=config.lr, warmup_steps=config.warmup_steps, min_lr_ratio=1.0)


@functools.cache
def tuning_step(model: Transformer, config: TrainConfig):
  """kvjax.training.step's jitted train step for `model` under `config`'s optimizer, made once per
  (model, optimizer) so every task's fine-tuning runs one compiled step."""
  return make_train_step(model, make_optimizer(config))


@functools.partial(jax.jit, static_argnames="model")
def _sums(model: Transformer, params, inputs, targets, mask):
  loss, hits = masked_loss(model, params, inputs, targets, mask)
  return loss.sum(), hits.sum()


def finetune(model: Transformer, params, task: str, config: TaskConfig):
  """-> (fine-tuned params, the last step's train loss or None when config.steps is 0), trained by
  kvjax.training.step's train step with the loss on each example's masked targets. `params` are copied
  first and left as they are (the step donates its state)."""
  check_task(task)
  check_model(model, config)
  if config.steps == 0:
    return params, None
  optimizer_config = tuning(config)
  step = tuning_step(model, optimizer_config)
  state = init_state(model, make_optimizer(optimizer_config), jax.random.key(0), jax.tree.map(jnp.copy, params))
  for batch in train_batches(task, config):
    state, metrics = step(state, batch.inputs, batch.targets, batch.mask)
  return state.params, float(metrics["loss"])


def teacher_forced(model: Transformer, params, examples: Examples, batch_size: int) -> dict:
  """Mean loss (nats) and accuracy (%) over the masked targets, in batches of batch_size rows (the
  last padded with unscored rows) so the compiled shapes are the train step's."""
  pad = -len(examples.inputs) % batch_size
  arrays = [
    np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
    for x in (examples.inputs, examples.targets, examples.mask)
  ]
  loss, hits = 0.0, 0
  for i in range(0, len(arrays[0]), batch_size):
    total, correct = _sums(model, params, *(x[i : i + batch_size] for x in arrays))
    loss, hits = loss + float(total), hits + int(correct)
  count = float(examples.mask.sum())
  return {"loss": loss / count, "accuracy": 100.0 * hits / count}


def produced(row: np.ndarray) -> np.ndarray:
  """A greedy output int[N] up to its first newline (all of it when it has none)."""
  stop = np.flatnonzero(row == NEWLINE)
  return row[: stop[0]] if len(stop) else row


def exact_match(outputs, answers: tuple[bytes, ...]) -> float:
  """Percent of rows whose output int[B, N], up to its first newline, is the answer (bytes, no
  newline). An output with no newline matches nothing: N exceeds every answer's length."""
  hits = 0
  for row, answer in zip(np.asarray(outputs), answers):
    out = produced(row)
    hits += len(out) == len(answer) and bool((out == np.frombuffer(answer, np.uint8)).all())
  return 100.0 * hits / len(answers)


def byte_accuracy(outputs, answers: tuple[bytes, ...]) -> float:
  """Mean over rows (%) of the answer's bytes the output int[B, N] (up to its first newline)
  reproduces at their positions, over the longer of output and answer: 100 for the answer
  itself, partial credit for a near miss, and a run-on or truncated output pays for its length."""
  total = 0.0
  for row, answer in zip(np.asarray(outputs), answers):
    out, want = produced(row), np.frombuffer(answer, np.uint8)
    n = min(len(out), len(want))
    total += float((out[:n] == want[:n]).sum()) / max(len(out), len(want), 1)
  return 100.0 * total / len(answers)


def greedy_outputs(model: Transformer, params, examples: Examples) -> np.ndarray:
  """Greedy continuations int32 [n, longest answer + 1] of every prompt, through the KV cache in
  one kvjax.generate call (one compilation per model and held-out set)."""
  longest = max(map(len, examples.prompts))
  prompts = np.zeros((len(examples.prompts), longest), np.int32)
  for i, prompt in enumerate(examples.prompts):
    prompts[i, : len(prompt)] = np.frombuffer(prompt, np.uint8)
  lengths = np.array([len(p) for p in examples.prompts], np.int32)
  return np.asarray(generate(model, params, prompts, lengths, max(map(len, examples.answers)) + 1, stop_ids=NEWLINE))


def score(model: Transformer, params, task: str, config: TaskConfig) -> dict:
  """{"score" (%), "metric", "eval_loss" (nats per scored byte, teacher-forced)} on the held-out
  examples, and "exact_match" (%) for the generated tasks."""
  check_task(task)
  check_model(model, config)
  examples = held_out(task, config)
  forced = teacher_forced(model, params, examples, config.batch_size)
  if task == "prose":
    return {"score": forced["accuracy"], "metric": "next-byte accuracy %", "eval_loss": forced["loss"]}
  outputs = greedy_outputs(model, params, examples)
  return {
    "score": byte_accuracy(outputs, examples.answers),
    "metric": "greedy byte accuracy %",
    "exact_match": exact_match(outputs, examples.answers),
    "eval_loss": forced["loss"],
  }


def finetune_and_score(model: Transformer, params, task: str, config: TaskConfig) -> dict:
  """Fine-tunes a copy of `params` on `task` for config.steps steps and scores it on the held-out
  examples -> {"task", "score", "metric", "eval_loss", "steps", "loss" (the last train loss)}."""
  tuned, loss = finetune(model, params, task, config)
  return {"task": task, **score(model, tuned, task, config), "steps": config.steps, "loss": loss}


def score_all(model: Transformer, params, config: TaskConfig) -> dict[str, dict]:
  """finetune_and_score for every task of config.tasks, each from the same `params`."""
  return {task: finetune_and_score(model, params, task, config) for task in config.tasks}


def average_score(results: dict[str, dict]) -> float:
  """The mean score over tasks (the paper's "avg score")."""
  if not results:
    raise ValueError("average_score needs at least one task's result")
  return math.fsum(r["score"] for r in results.values()) / len(results)
