"""Needle recall for a model with a tokenizer (an imported pretrained model): a pass key hidden
in held-out prose, asked for at the end of the prompt, at chosen distances in tokens.

One example, in the model's tokens (`lead`, `filler` windows of held-out English prose, the
"prose" corpus of kvjax.training.data, cut at random token offsets):

    <instruction> <lead> The pass key is 48213. Remember it. 48213 is the pass key. <filler>
    What is the pass key?
    -> answer "The pass key is" ... greedy continuation, scored by its first number

A chat model (one with a chat template) gets the prompt as one user message and the answer
prefix at the start of its reply, as it would be asked; a base model reads the text as it is.
The distance D is the number of tokens from the needle sentence's first token to the prompt's
last token, so a sliding window must span D positions to see the key; the filler's length is
chosen per example to make D exact. Scored by exact match: the first number of the greedy answer
equals the key. Everything is drawn from a generator seeded by (seed, D): the same config gives
the same examples for every model with the same tokenizer.

The answers are decoded through a KV cache: the contiguous cache of the model's cache_dtype
(kvjax.generate), or, with paged=True, the paged cache of the continuous-batching engine.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from kvjax.config import check_nonnegative, check_positive, check_positive_int
from kvjax.decoding.decode import generate
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.training.checkpoint import latest_step, load_model
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about it.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key?"
ANSWER = "The pass key is"
PLACEHOLDER = "\x00kvjax-user-message\x00"


@dataclasses.dataclass(frozen=True)
class PasskeyConfig:
  """`needles` examples at each of `distances` (tokens), keys of `digits` digits, the needle
  after `lead` tokens of prose; answers of at most answer_tokens greedy tokens."""

  distances: tuple[int, ...] = (256, 512, 1024)
  needles: int = 8
  digits: int = 5
  lead: int = 32
  answer_tokens: int = 10
  seed: int = 0

  def __post_init__(self):
    check_positive(self, "needles", "digits", "answer_tokens")
    check_nonnegative(self, "seed", "lead")
    if not isinstance(self.distances, tuple) or not self.distances:
      raise ValueError(f"PasskeyConfig.distances must be a non-empty tuple of token distances, got {self.distances!r}")
    for i, distance in enumerate(self.distances):
      check_positive_int(distance, f"PasskeyConfig.distances[{i}]")
    if len(set(self.distances)) != len(self.distances):
      raise ValueError(f"PasskeyConfig.distances must be distinct, got {self.distances!r}")


@dataclasses.dataclass(frozen=True)
class Frame:
  """A prompt's fixed token pieces: before the user text (chat template opening, may be empty),
  the question, and after the question through the answer prefix."""

  opening: np.ndarray
  question: np.ndarray
  closing: np.ndarray

  @classmethod
  def of(cls, tokenizer: TextTokenizer) -> "Frame":
    question = tokenizer.encode(QUESTION)
    if tokenizer.chat_template is None:  # plain text, with the bos a plain prompt starts with (if any)
      return cls(tokenizer.encode(INSTRUCTION, add_special_tokens=True), question, tokenizer.encode(" " + ANSWER))
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True)
    opening, closing = text.split(PLACEHOLDER)
    return cls(tokenizer.encode(opening + INSTRUCTION), question, tokenizer.encode(closing + ANSWER))


def examples(tokenizer: TextTokenizer, config: PasskeyConfig, distance: int, prose: np.ndarray):
  """The examples at one distance -> (prompts int32 [n, P] right-padded, lengths int32 [n], keys
  [n] as str). `prose`: held-out prose tokens the lead and filler are cut from."""
  frame = Frame.of(tokenizer)
  rng = np.random.default_rng([config.seed, distance])
  rows, keys = [], []
  for _ in range(config.needles):
    key = str(int(rng.integers(10 ** (config.digits - 1), 10 ** config.digits)))
    needle = tokenizer.encode(NEEDLE.format(key=key))
    fill = distance - len(needle) - len(frame.question) - len(frame.closing)
    if fill < 0:
      raise ValueError(f"PasskeyConfig.distances: {distance} tokens cannot hold the needle sentence, the question "
                       f"and the answer prefix ({distance - fill} tokens for this tokenizer)")
    if len(prose) < config.lead + fill + 1:
      raise ValueError(f"the held-out prose has {len(prose)} tokens, fewer than distance {distance} needs")
    lead_at, fill_at = rng.integers(len(prose) - config.lead + 1), rng.integers(len(prose) - fill + 1)
    rows.append(np.concatenate([frame.opening, prose[lead_at:lead_at + config.lead], needle,
                                prose[fill_at:fill_at + fill], frame.question, frame.closing]).astype(np.int32))
    keys.append(key)
  lengths = np.array([len(r) for r in rows], np.int32)
  prompts = np.zeros((len(rows), lengths.max()), np.int32)
  for i, row in enumerate(rows):
    prompts[i, :len(row)] = row
  return prompts, lengths, keys


def answered(text: str, key: str) -> bool:
  """Exact match: the first number in the answer is the key."""
  found = re.search(r"\d+", text)
  return found is not None and found.group() == key


def answers(model: Transformer, params, prompts: np.ndarray, lengths: np.ndarray, new_tokens: int,
            stop_ids, *, paged: bool = False) -> list[np.ndarray]:
  """Greedy answers [n] of int32 tokens (cut at the first stop token) through the contiguous
  cache (generate) or the engine's paged cache."""
  if not paged:
    out = np.asarray(generate(model, params, prompts, lengths, new_tokens, stop_ids=stop_ids))
    cut = [np.flatnonzero(np.isin(row, stop_ids)) for row in out]
    return [row[:c[0]] if c.size else row for row, c in zip(out, cut)]
  page_size = 16
  longest = int(lengths.max()) + new_tokens
  pages = -(-longest // page_size)
  engine = Engine(model, params, EngineConfig(num_slots=len(prompts), num_pages=len(prompts) * pages + 1,
                                              page_size=page_size, max_len=pages * page_size, stop_ids=tuple(stop_ids)))
  ids = [engine.submit(prompt[:length], new_tokens) for prompt, length in zip(prompts, lengths)]
  out = engine.run()
  return [out[i][:-1] if len(out[i]) and out[i][-1] in stop_ids else out[i] for i in ids]


def passkey(model: Transformer, params, tokenizer: TextTokenizer, config: PasskeyConfig, *,
            paged: bool = False) -> dict[str, dict]:
  """Exact-match recall per distance -> {str(D): {"distance", "exact_match", "needles", "answers"}}."""
  longest = max(config.distances) + len(Frame.of(tokenizer).opening) + config.lead + config.answer_tokens
  model.config.check_length(longest, f"PasskeyConfig.distances: distance {max(config.distances)} needs {longest} "
                                     "positions")
  prose = load_dataset(DataConfig(source=PROSE, seq_len=1), tokenizer).val
  out = {}
  for distance in config.distances:
    prompts, lengths, keys = examples(tokenizer, config, distance, prose)
    texts = [tokenizer.decode(a) for a in answers(model, params, prompts, lengths, config.answer_tokens,
                                                  tokenizer.stop_ids, paged=paged)]
    hits = [answered(text, key) for text, key in zip(texts, keys)]
    out[str(distance)] = {"distance": distance, "exact_match": float(np.mean(hits)), "needles": config.needles,
                          "answers": [{"key": k, "answer": t} for k, t in zip(keys, texts)]}
  return out


def passkey_checkpoint(workdir: str | Path, config: PasskeyConfig, *, step: int | None = None,
                       cache_dtype: str | None = None, paged: bool = False) -> dict:
  """`passkey` of a workdir's checkpoint (latest unless `step`) with its tokenizer, through a cache
  of `cache_dtype` (default: the model's), paged or contiguous."""
  step = latest_step(workdir) if step is None else step
  model, params, _ = load_model(workdir, step)
  tokenizer = TextTokenizer.load(workdir, model.config.vocab_size)
  if tokenizer is None:
    raise ValueError(f"{workdir} has no tokenizer: the pass-key test is for tokenized models (the byte-level "
                     "recall test serves models trained here)")
  if cache_dtype is not None:
    model = model.clone(config=model.config.replace(cache_dtype=cache_dtype))
  return {"step": step, "test": "passkey", "digits": config.digits, "seed": config.seed,
          "cache_dtype": model.config.cache_dtype, "cache": "paged" if paged else "contiguous",
          "recall": passkey(model, params, tokenizer, config, paged=paged)}
