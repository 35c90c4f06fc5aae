"""The pieces every task of the RULER-style suite (kvjax.studies.suite.ruler_tasks) is built from:
RULER's published prompt templates, the seeded keys and values (numbers, words of Python's
documentation, uuid4s), the chat / base-model frame around a context, and `fill`, which makes a
haystack of an exact number of tokens with needles between its whole units."""

from __future__ import annotations

import dataclasses
import functools
import re
import uuid

import numpy as np

from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies.suite.passkey import PLACEHOLDER, Prose
from kvjax.training.data import documentation

# RULER's templates (scripts/data/synthetic/constants.py): (template, answer prefix, tokens_to_generate).
NIAH = (
  "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
  "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
  "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
  " The special magic {type_needle_v} for {query} mentioned in the provided text are",
  128,
)
VT = (
  "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
  "Question: Find all variables that are assigned the value {query} in the text above.",
  " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
  "assigned the value {query}, they are: ",
  30,
)
CWE = (
  "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
  "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
  " Answer: The top 10 words that appear most often in the list are:",
  120,
)
FWE = (
  "Read the following coded text and track the frequency of each coded word. Find the three most "
  "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
  "the dots '....'. What are the three most frequently appeared words in the above coded text?",
  " Answer: According to the coded text above, the three most frequently appeared words are:",
  50,
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEMPLATES = ("auto", "chat", "base")


@functools.cache
def words() -> tuple[str, ...]:
  """The distinct lowercase words of 4 to 10 letters of Python's documentation, sorted: the pool
  that word keys, word values and the common-words task draw from."""
  text = b"\n\n".join(documentation()).decode()
  return tuple(sorted(set(re.findall(r"(?<![\w.-])[a-z]{4,10}(?![\w-])", text))))


def value(kind: str, rng: np.random.Generator) -> str:
  """A key or value of a type: a 7-digit number, two words joined by '-' (RULER: adjective-noun)
  or a uuid4."""
  if kind == "numbers":
    return str(int(rng.integers(10**6, 10**7)))
  if kind == "words":
    pool = words()
    return f"{pool[rng.integers(len(pool))]}-{pool[rng.integers(len(pool))]}"
  return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))


def distinct(kind: str, count: int, rng: np.random.Generator, avoid=()) -> list[str]:
  """`count` distinct values of a type, none in `avoid`."""
  out: list[str] = []
  while len(out) < count:
    v = value(kind, rng)
    if v not in out and v not in avoid:
      out.append(v)
  return out


@dataclasses.dataclass(frozen=True)
class Frame:
  """The token pieces around a context: `head` (the prompt up to the context: a chat template's
  opening, or a plain prompt's bos) and `tail` (the question, the end of the user turn and the
  opening of the reply, the answer prefix)."""

  head: np.ndarray
  tail: np.ndarray

  @classmethod
  def of(cls, tokenizer: TextTokenizer, template: str, head: str, question: str, answer_prefix: str) -> "Frame":
    if template == "base":
      return cls(tokenizer.encode(head, add_special_tokens=True), tokenizer.encode(question + answer_prefix))
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True)
    opening, closing = text.split(PLACEHOLDER)
    # RULER puts the answer prefix at the start of the model's turn, after the template.
    return cls(tokenizer.encode(opening + head), tokenizer.encode(question + closing + answer_prefix.lstrip()))


def resolve_template(tokenizer: TextTokenizer, template: str) -> str:
  """ "chat" or "base": "auto" is chat when the tokenizer has a chat template."""
  if template not in TEMPLATES:
    raise ValueError(f"RULER template must be one of {TEMPLATES}, got {template!r}")
  if template == "auto":
    return "base" if tokenizer.chat_template is None else "chat"
  if template == "chat" and tokenizer.chat_template is None:
    raise ValueError("RULER template='chat' needs a tokenizer with a chat template; this one has none (use 'base')")
  return template


def split(template: str, context_field: str = "{context}") -> tuple[str, str]:
  """A RULER template -> (the text before the context, the text after it)."""
  before, after = template.split(context_field)
  return before, after


class TooShort(ValueError):
  """The length cannot hold a task's fixed parts and a minimal haystack."""


def too_short(task: str, length: int, needed: int) -> TooShort:
  return TooShort(
    f"RULER task {task}: length {length} is too short for its template, needles and a haystack "
    f"(at least {needed} tokens for this tokenizer)"
  )


def fill(units, pieces: list[np.ndarray], budget: int, rng: np.random.Generator, what) -> tuple[np.ndarray, list[int]]:
  """A haystack of exactly `budget` ids: whole units from the iterator `units` (each unit's ids),
  then the first ids of one more, with `pieces` (needles, in order) between whole units at random
  boundaries after the first unit -> (ids, the offset of each piece). `what(needed)`: the error
  for a budget too small for one whole unit and the pieces."""
  room = budget - sum(len(p) for p in pieces)
  taken, total = [], 0
  while total < room:
    unit = next(units)
    taken.append(unit)
    total += len(unit)
  whole = len(taken) - (total > room)
  if whole < 1:
    raise what(budget - room + (len(taken[0]) if taken else 1))
  taken[-1] = taken[-1][: len(taken[-1]) - (total - room)]
  after = sorted(int(b) for b in rng.integers(1, whole + 1, size=len(pieces)))
  out, offsets, at = [], [], 0
  for i, unit in enumerate(taken):
    out.append(unit)
    at += len(unit)
    while after and after[0] == i + 1:
      after.pop(0)
      offsets.append(at)
      piece = pieces[len(offsets) - 1]
      out.append(piece)
      at += len(piece)
  return np.concatenate(out).astype(np.int32), offsets


def repeated(first: np.ndarray, rest: np.ndarray):
  """first, then rest forever."""
  yield first
  while True:
    yield rest


def prose_units(prose: Prose, rng: np.random.Generator):
  """Consecutive prose sentences from a random one, around the prose as often as needed."""
  i = int(rng.integers(len(prose.starting)))
  yield prose.starting[i]
  while True:
    i = (i + 1) % len(prose.following)
    yield prose.following[i]


@functools.cache
def prose_of(tokenizer: TextTokenizer) -> Prose:
  """The prose sentences of all of Python's documentation in tokenizer's ids (RULER's essays)."""
  return Prose.of(tokenizer, b"\n\n".join(documentation()).decode())


def sample(frame: Frame, context: np.ndarray, references: list[str], offset: int | None = None) -> dict:
  """The sample's fields: context_ids (frame head + context), question_ids, references, and for a
  needle at token `offset` of the context its depth (0..1 of the prompt) and distance (tokens from
  the needle's first token to the prompt's end)."""
  context_ids = np.concatenate([frame.head, context]).astype(np.int32)
  out = {
    "context_ids": context_ids.tolist(),
    "question_ids": frame.tail.astype(np.int32).tolist(),
    "references": references,
  }
  if offset is not None:
    at = len(frame.head) + offset
    total = len(context_ids) + len(frame.tail)
    out.update(depth=round(at / total, 4), distance=total - at)
  return out
