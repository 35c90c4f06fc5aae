"""Needle recall for a model with a tokenizer (an imported pretrained model): a pass key hidden
in held-out prose, asked for at the end of the prompt, at chosen distances in tokens.

The prompt is the pass-key retrieval test of Mohtashami & Jaggi (2023, "Landmark Attention"),
their lines joined by line breaks, with held-out English prose for their repeated filler
sentences: whole sentences of the prose paragraphs of Python's documentation (the held-out part
of kvjax.training.data.documentation; code, tables and headings left out, lines unwrapped). One
example, as text:

    There is an important info hidden inside a lot of irrelevant text. Find it and ... there.
    <lead: whole sentences, `lead` tokens>
    The pass key is 48213. Remember it. 48213 is the pass key.
    <filler: whole sentences>
    What is the pass key?

A chat model (one with a chat template) gets these lines as one user message and answers in
its own turn (SmolLM2-135M-Instruct did worse with "The pass key is" put at the start of its
reply, and answers "The pass key is 48213." by itself); a base model reads the text as it is,
the last line "What is the pass key? The pass key is". The distance D is the number of tokens
from the needle sentence's first token to the prompt's last token, so a sliding window must
span D positions to see the key. D is exact and every sentence whole: the lead and the filler
are runs of consecutive sentences (after the space or paragraph break that precedes each in the
text, but the first) whose ids sum to exactly the tokens wanted, each drawn at random among all
such runs of the prose. The parts are encoded one by one and their ids joined, so the prompt is
that sequence of ids (re-encoding its text may merge a token across a part boundary).

Scored by exact match: the first number of the greedy answer equals the key. Everything is drawn
from a generator seeded by (seed, D): the same config gives the same examples for every model
with the same tokenizer. The answers are decoded through the KV cache of a CacheConfig: a
contiguous one by kvjax.generate, a paged one by the continuous-batching engine
(kvjax.studies.measure.answers).
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.fields import check_nonnegative, check_positive, check_positive_int, to_dict
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.model.weights import check_format, store
from kvjax.studies import measure
from kvjax.training.checkpoint import latest_step, load_model
from kvjax.training.data import documentation, paragraphs_of

INSTRUCTION = (
  "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
  "I will quiz you about the important information there."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER = "The pass key is"
SEPARATOR = "\n"  # between the parts of the prompt: each its own line, as Mohtashami & Jaggi join them
PARAGRAPH = "\n\n"  # between the prose's paragraphs, as in the text
PLACEHOLDER = "\x00kvjax-user-message\x00"


@dataclasses.dataclass(frozen=True)
class PasskeyConfig:
  """`needles` examples at each of `distances` (tokens), keys of `digits` digits, the needle
  after `lead` tokens of prose; answers of at most answer_tokens greedy tokens, decoded
  batch_size examples at a time (a prefill's memory grows with batch x prompt length)."""

  distances: tuple[int, ...] = (256, 512, 1024)
  needles: int = 8
  digits: int = 5
  lead: int = 32
  answer_tokens: int = 10
  batch_size: int = 2
  seed: int = 0

  def __post_init__(self):
    check_positive(self, "needles", "digits", "answer_tokens", "batch_size")
    check_nonnegative(self, "seed", "lead")
    if not isinstance(self.distances, tuple) or not self.distances:
      raise ValueError(f"PasskeyConfig.distances must be a non-empty tuple of token distances, got {self.distances!r}")
    for i, distance in enumerate(self.distances):
      check_positive_int(distance, f"PasskeyConfig.distances[{i}]")
    if len(set(self.distances)) != len(self.distances):
      raise ValueError(f"PasskeyConfig.distances must be distinct, got {self.distances!r}")


def prose_sentences(text: str) -> list[tuple[str, str]]:
  """The sentences of the prose paragraphs of `text` -> [(what precedes it, sentence)]: a space
  within a paragraph, PARAGRAPH before a paragraph's first ('' before the very first).

  A prose paragraph is one whose lines share one indentation and that starts with a capital
  and ends with a full stop; this leaves out the documentation's code, grammar, tables and
  headings. Its lines are unwrapped; sentences end at '.', '!' or '?' before a capital."""
  out = []
  for paragraph in paragraphs_of(text):
    lines = paragraph.split("\n")
    if len({len(line) - len(line.lstrip()) for line in lines}) > 1:
      continue
    paragraph = " ".join(textwrap.dedent(paragraph).split())
    if not re.fullmatch(r"[A-Z].*\.", paragraph):
      continue
    for i, sentence in enumerate(re.split(r"(?<=[.!?]) (?=[A-Z])", paragraph)):
      out.append((" " if i else PARAGRAPH if out else "", sentence))
  return out


@dataclasses.dataclass(frozen=True)
class Prose:
  """Sentences in one tokenizer's ids, to cut runs of an exact number of tokens from.

  Attributes:
    starting: int32 ids of each sentence alone (the first of a run).
    following: int32 ids of each sentence after what precedes it in the text (the rest of a run).
  """

  starting: tuple[np.ndarray, ...]
  following: tuple[np.ndarray, ...]

  @classmethod
  def of(cls, tokenizer: TextTokenizer, text: str | None = None) -> "Prose":
    """The prose sentences of `text` (default: the held-out documentation) in tokenizer's ids."""
    sentences = prose_sentences(documentation()[1].decode() if text is None else text)
    if not sentences:
      raise ValueError("the pass-key test's prose has no sentences")
    return cls(
      tuple(tokenizer.encode(s) for _, s in sentences), tuple(tokenizer.encode(before + s) for before, s in sentences)
    )

  def run(self, length: int, rng: np.random.Generator) -> np.ndarray:
    """int32 [length]: consecutive whole sentences with exactly `length` ids in all, drawn
    uniformly among every such run; ValueError when the prose has none."""
    if length == 0:
      return np.zeros(0, np.int32)
    ends = np.concatenate([[0], np.cumsum([len(s) for s in self.following])])  # ids through sentence i - 1
    first = np.array([len(s) for s in self.starting])
    # The run from sentence i through sentence j - 1 has first[i] + ends[j] - ends[i + 1] ids;
    # `ends` increases strictly, so one j at most fits each i.
    want = length - first + ends[1:]
    j = np.minimum(np.searchsorted(ends, want), len(ends) - 1)
    starts = np.flatnonzero((ends[j] == want) & (want >= ends[1:]))
    if not starts.size:
      raise ValueError(
        f"no run of whole sentences of the pass-key prose has exactly {length} tokens: choose another distance or lead"
      )
    i = int(starts[rng.integers(starts.size)])
    stop = int(j[i])
    return np.concatenate([self.starting[i], *self.following[i + 1 : stop]]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Frame:
  """A prompt's fixed token pieces: `opening` through the instruction and the separator after it
  (the chat template's opening first, or a plain prompt's bos), `separator`, and `closing`: from
  the separator before the question to the prompt's end (the chat template's opening of the
  reply, or a plain prompt's answer prefix)."""

  opening: np.ndarray
  separator: np.ndarray
  closing: np.ndarray

  @classmethod
  def of(cls, tokenizer: TextTokenizer) -> "Frame":
    separator = tokenizer.encode(SEPARATOR)
    if tokenizer.chat_template is None:
      return cls(
        tokenizer.encode(INSTRUCTION + SEPARATOR, add_special_tokens=True),
        separator,
        tokenizer.encode(f"{SEPARATOR}{QUESTION} {ANSWER}"),
      )
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True)
    opening, closing = text.split(PLACEHOLDER)
    return cls(
      tokenizer.encode(opening + INSTRUCTION + SEPARATOR), separator, tokenizer.encode(SEPARATOR + QUESTION + closing)
    )

  def length(self, lead: int, distance: int) -> int:
    """The tokens of a prompt with `lead` tokens of prose before a needle `distance` from its end."""
    return len(self.opening) + lead + len(self.separator) + distance


def examples(tokenizer: TextTokenizer, config: PasskeyConfig, distance: int, prose: Prose):
  """The examples at one distance -> (prompts int32 [n, P] right-padded, lengths int32 [n], keys
  [n] as str). `prose`: the sentences the lead and the filler are cut from (Prose.of(tokenizer))."""
  frame = Frame.of(tokenizer)
  rng = np.random.default_rng([config.seed, distance])
  rows, keys = [], []
  for _ in range(config.needles):
    key = str(int(rng.integers(10 ** (config.digits - 1), 10**config.digits)))
    needle = tokenizer.encode(NEEDLE.format(key=key) + SEPARATOR)
    fill = distance - len(needle) - len(frame.closing)
    if fill < 0:
      raise ValueError(
        f"PasskeyConfig.distances: {distance} tokens cannot hold the needle sentence and the "
        f"question ({distance - fill} tokens for this tokenizer)"
      )
    lead = prose.run(config.lead, rng)
    rows.append(
      np.concatenate([frame.opening, lead, frame.separator, needle, prose.run(fill, rng), frame.closing]).astype(
        np.int32
      )
    )
    keys.append(key)
  lengths = np.array([len(r) for r in rows], np.int32)
  prompts = np.zeros((len(rows), lengths.max()), np.int32)
  for i, row in enumerate(rows):
    prompts[i, : len(row)] = row
  return prompts, lengths, keys


def answered(text: str, key: str) -> bool:
  """Exact match: the first number in the answer is the key."""
  found = re.search(r"\d+", text)
  return found is not None and found.group() == key


def passkey(
  model: Transformer,
  params,
  tokenizer: TextTokenizer,
  config: PasskeyConfig,
  *,
  cache_config: CacheConfig = CacheConfig(),
) -> dict[str, dict]:
  """Exact-match recall per distance through a cache of cache_config (kvjax.studies.measure.recall,
  config.batch_size examples at a time) -> {str(D): {"distance", "exact_match", "needles",
  "samples"}}; samples: one record per example ({"index", "key", "answer", "hit"})."""
  longest = Frame.of(tokenizer).length(config.lead, max(config.distances)) + config.answer_tokens
  cache_config.model(model.config).check_length(
    longest, f"PasskeyConfig.distances: distance {max(config.distances)} needs {longest} positions"
  )
  prose = Prose.of(tokenizer)
  out = {}
  for distance in config.distances:
    prompts, lengths, keys = examples(tokenizer, config, distance, prose)
    exact, samples = measure.recall(
      model,
      params,
      prompts,
      lengths,
      keys,
      judge(tokenizer),
      config.answer_tokens,
      cache_config,
      batch_size=config.batch_size,
      stop_ids=tokenizer.stop_ids,
    )
    out[str(distance)] = {"distance": distance, "exact_match": exact, "needles": config.needles, "samples": samples}
  return out


def judge(tokenizer: TextTokenizer):
  """judge(answer ids, key) -> one sample's record {"key", "answer" (text), "hit" (answered)}."""

  def record(answer: np.ndarray, key: str) -> dict:
    text = tokenizer.decode(answer)
    return {"key": key, "answer": text, "hit": answered(text, key)}

  return record


def passkey_checkpoint(
  workdir: str | Path,
  config: PasskeyConfig,
  *,
  step: int | None = None,
  cache_config: CacheConfig | None = None,
  weights: str = "float32",
) -> dict:
  """`passkey` of a workdir's checkpoint (latest unless `step`) with its tokenizer, through a cache
  of `cache_config` (default: contiguous, the model's dtype), the weights stored as `weights`."""
  check_format(weights)
  step = latest_step(workdir) if step is None else step
  model, params, _ = load_model(workdir, step)
  params = store(params, weights)
  tokenizer = TextTokenizer.load(workdir, model.config.vocab_size)
  if tokenizer is None:
    raise ValueError(
      f"{workdir} has no tokenizer: the pass-key test is for tokenized models (the byte-level "
      "recall test serves models trained here)"
    )
  cache_config = cache_config or CacheConfig()
  return {
    "step": step,
    "test": "passkey",
    "digits": config.digits,
    "seed": config.seed,
    "cache": to_dict(cache_config),
    "weights": weights,
    "recall": passkey(model, params, tokenizer, config, cache_config=cache_config),
  }
