"""Needle recall for a model with a tokenizer (an imported pretrained model): a pass key hidden
at a random depth of held-out prose, asked for at the end of a prompt of an exact length.

The prompt follows the pass-key retrieval test of Mohtashami & Jaggi (2023, "Landmark
Attention"), their lines joined by line breaks, with held-out English prose for their repeated
filler sentences: whole sentences of the prose paragraphs of Python's documentation (the
held-out part of kvjax.training.data.documentation; code, tables and headings left out, lines
unwrapped). One example, as text, in the default wording ("secret"):

    There is an important info hidden inside a lot of irrelevant text. Find it and ... there.
    <lead: whole sentences>
    The secret passkey is 48213. Remember it.
    <filler: whole sentences>
    What is the secret passkey? Answer with the number only.

The wording is a value (WORDINGS). Mohtashami & Jaggi's own ("The pass key is 48213. Remember
it. 48213 is the pass key." / "What is the pass key?") loses SmolLM2-135M-Instruct in a haystack
of Python's documentation, where "key" is a Python word: it answers "The pass key is a special
attribute of ...". "secret passkey" and "Answer with the number only" keep it on the needle
(docs/results.md has what each wording scored). A chat model (one with a chat template) gets the
lines as one user message and answers in its own turn; a base model reads the text as it is, the
last line ending in the wording's answer prefix ("The secret passkey is").

Every prompt is exactly `length` tokens: context_ids (the opening, the instruction, the
haystack with the needle) + question_ids (from the line break before the question to the
prompt's end: the chat template's opening of the reply, or a base model's answer prefix). The
needle's depth is drawn uniformly over the haystack's tokens; its distance (tokens from the
needle sentence's first token to the prompt's last, what a sliding window must span to see the
key) follows, and both are kept with each sample. The lead and the filler are runs of whole
consecutive sentences with exactly the tokens wanted, each drawn at random among all such runs
(a depth no run fits is drawn again). The parts are encoded one by one and their ids joined, so
the prompt is that sequence of ids (re-encoding its text may merge a token across a boundary).

The answer budget (answer_budget) holds twice the expected answer sentence ("The secret passkey
is 48213." in the tokenizer's ids): SmolLM2's tokenizer spends one token per digit, so a budget
of 10 cuts "The secret passkey is 4821" before the key ends and scores a model that found the
key as one that did not. Scored as RULER scores (kvjax.studies.base.scoring.score): the key appears
in the answer. Everything is drawn from a generator seeded by (seed, length): the same config
gives the same examples for every model with the same tokenizer. The answers are decoded
through the KV cache of a CacheConfig: a contiguous one by kvjax.generate, a paged one by the
continuous-batching engine (kvjax.studies.base.measure.answers).
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

import numpy as np

from kvjax.fields import check_nonnegative, check_positive, check_positive_int
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies.base.scoring import score
from kvjax.training.data import documentation, paragraphs_of

TASK = "passkey"
SEPARATOR = "\n"  # between the parts of the prompt: each its own line, as Mohtashami & Jaggi join them
PARAGRAPH = "\n\n"  # between the prose's paragraphs, as in the text
PLACEHOLDER = "\x00kvjax-user-message\x00"
DEPTH_DRAWS = 1000  # depths drawn before a length is refused as one no run of sentences fits


@dataclasses.dataclass(frozen=True)
class Wording:
  """The words of one pass-key prompt: `instruction` (first line), `needle` (with {key}),
  `question` (last line), `answer`: the expected answer sentence (with {key}); what precedes
  {key} in it is a base model's answer prefix."""

  instruction: str
  needle: str
  question: str
  answer: str

  @property
  def prefix(self) -> str:
    return self.answer.split("{key}")[0].rstrip()


LANDMARK = (
  "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
  "I will quiz you about the important information there."
)
WORDINGS = {
  "secret": Wording(
    LANDMARK,
    "The secret passkey is {key}. Remember it.",
    "What is the secret passkey? Answer with the number only.",
    "The secret passkey is {key}.",
  ),
  "landmark": Wording(
    LANDMARK,
    "The pass key is {key}. Remember it. {key} is the pass key.",
    "What is the pass key?",
    "The pass key is {key}.",
  ),
  "magic": Wording(  # RULER's niah_single_1 (Hsieh et al. 2024), with one number and no query word
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.",
    "The special magic number is: {key}.",
    "What is the special magic number mentioned in the provided text?",
    "The special magic number mentioned in the provided text is {key}.",
  ),
}


@dataclasses.dataclass(frozen=True)
class PasskeyConfig:
  """`needles` examples at each of `lengths` (prompt tokens), keys of `digits` digits, in
  WORDINGS[wording], answered batch_size examples at a time (a prefill's memory grows with
  batch x prompt length).

  answer_tokens: None answers in answer_budget's tokens (twice the expected answer sentence, per
  tokenizer); a number is a larger budget, and one below that rule is refused when the tokenizer
  is known (passkey()), naming both: a budget that cuts the key measures the budget."""

  lengths: tuple[int, ...] = (512, 1024)
  needles: int = 24
  digits: int = 5
  answer_tokens: int | None = None
  batch_size: int = 2
  seed: int = 0
  wording: str = "secret"

  def __post_init__(self):
    check_positive(self, "needles", "digits", "batch_size")
    check_nonnegative(self, "seed")
    if self.answer_tokens is not None:
      check_positive(self, "answer_tokens")
    if self.wording not in WORDINGS:
      raise ValueError(f"PasskeyConfig.wording must be one of {tuple(WORDINGS)}, got {self.wording!r}")
    if not isinstance(self.lengths, tuple) or not self.lengths:
      raise ValueError(f"PasskeyConfig.lengths must be a non-empty tuple of prompt lengths, got {self.lengths!r}")
    for i, length in enumerate(self.lengths):
      check_positive_int(length, f"PasskeyConfig.lengths[{i}]")
    if len(set(self.lengths)) != len(self.lengths):
      raise ValueError(f"PasskeyConfig.lengths must be distinct, got {self.lengths!r}")


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

  def run(self, length: int, rng: np.random.Generator) -> np.ndarray | None:
    """int32 [length]: consecutive whole sentences with exactly `length` ids in all, drawn
    uniformly among every such run; None when the prose has none."""
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
      return None
    i = int(starts[rng.integers(starts.size)])
    return np.concatenate([self.starting[i], *self.following[i + 1 : int(j[i])]]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Frame:
  """A prompt's fixed token pieces: `opening` through the instruction and the separator after it
  (the chat template's opening first, or a plain prompt's bos), `separator`, and `closing` (the
  question_ids): from the separator before the question to the prompt's end (the chat template's
  opening of the reply, or a plain prompt's answer prefix)."""

  opening: np.ndarray
  separator: np.ndarray
  closing: np.ndarray

  @classmethod
  def of(cls, tokenizer: TextTokenizer, wording: Wording = WORDINGS["secret"]) -> "Frame":
    separator = tokenizer.encode(SEPARATOR)
    if tokenizer.chat_template is None:
      return cls(
        tokenizer.encode(wording.instruction + SEPARATOR, add_special_tokens=True),
        separator,
        tokenizer.encode(f"{SEPARATOR}{wording.question} {wording.prefix}"),
      )
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True)
    opening, closing = text.split(PLACEHOLDER)
    return cls(
      tokenizer.encode(opening + wording.instruction + SEPARATOR),
      separator,
      tokenizer.encode(SEPARATOR + wording.question + closing),
    )


def answer_budget(tokenizer: TextTokenizer, config: PasskeyConfig, key: str) -> int:
  """The answer tokens for `key`: twice the tokens of the expected answer sentence in the
  tokenizer's ids (room for a preamble or a restated question), or config.answer_tokens;
  ValueError when that is below the rule."""
  rule = 2 * len(tokenizer.encode(WORDINGS[config.wording].answer.format(key=key)))
  if config.answer_tokens is None:
    return rule
  if config.answer_tokens < rule:
    raise ValueError(
      f"PasskeyConfig.answer_tokens={config.answer_tokens} cannot hold twice the expected answer "
      f"{WORDINGS[config.wording].answer.format(key=key)!r} ({rule} tokens for this tokenizer): "
      "leave it None or raise it"
    )
  return config.answer_tokens


def samples(tokenizer: TextTokenizer, config: PasskeyConfig, length: int, prose: Prose) -> list[dict]:
  """config.needles samples of exactly `length` prompt tokens, in the shared long-context format:
  {"id", "task", "length", "context_ids", "question_ids", "references" ([key]), "answer_tokens",
  "depth" (the needle's first token over the haystack, 0..1), "distance" (tokens from it to the
  prompt's end)}. `prose`: the sentences the lead and the filler are cut from (Prose.of)."""
  wording = WORDINGS[config.wording]
  frame = Frame.of(tokenizer, wording)
  rng = np.random.default_rng([config.seed, length])
  out = []
  for index in range(config.needles):
    key = str(int(rng.integers(10 ** (config.digits - 1), 10**config.digits)))
    needle = tokenizer.encode(wording.needle.format(key=key) + SEPARATOR)
    haystack = length - len(frame.opening) - len(frame.separator) - len(needle) - len(frame.closing)
    if haystack < 0:
      raise ValueError(
        f"PasskeyConfig.lengths: {length} tokens cannot hold the instruction, the needle sentence and the "
        f"question ({length - haystack} tokens for this tokenizer)"
      )
    for _ in range(DEPTH_DRAWS):
      lead = int(rng.integers(haystack + 1))
      before, after = prose.run(lead, rng), prose.run(haystack - lead, rng)
      if before is not None and after is not None:
        break
    else:
      raise ValueError(
        f"PasskeyConfig.lengths: no runs of whole sentences of the pass-key prose fill {length} tokens: choose "
        "another length"
      )
    context = np.concatenate([frame.opening, before, frame.separator, needle, after])
    out.append(
      {
        "id": f"{TASK}/{length}/{index}",
        "task": TASK,
        "length": length,
        "context_ids": context.astype(int).tolist(),
        "question_ids": frame.closing.astype(int).tolist(),
        "references": [key],
        "answer_tokens": answer_budget(tokenizer, config, key),
        "depth": lead / haystack if haystack else 0.0,
        "distance": length - len(frame.opening) - lead - len(frame.separator),
      }
    )
  return out


def judge(tokenizer: TextTokenizer):
  """judge(answer ids, sample) -> one sample's result: {"id", "task", "length", "answer" (the
  text of the first sample["answer_tokens"] ids), "score" (scoring.score), "hit" (score 1),
  "depth", "distance"}."""

  def result(answer: np.ndarray, sample: dict) -> dict:
    text = tokenizer.decode(np.asarray(answer)[: sample["answer_tokens"]])
    found = score(text, sample["references"])
    facts = {k: sample[k] for k in ("id", "task", "length", "depth", "distance")}
    return {**facts, "answer": text, "score": found, "hit": found == 1.0}

  return result
