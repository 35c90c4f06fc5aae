"""Byte-level tokenizer, corpora and seeded random training windows.

Tokens are UTF-8 bytes (vocabulary 256), so one token is one byte and bits per byte is the loss
in nats divided by ln 2. A corpus is a text file, a directory of text files, "stdlib": this
Python's standard-library .py sources, or "prose": the English of Python's own documentation
(pydoc_data.topics), split by `documentation` rather than by held_out_mask; neither needs a download. Files are read in sorted order and
concatenated up to DataConfig.max_bytes; the corpus sha256 and size are recorded with the run.

Batches are int32 [B, T] inputs and the same windows shifted by one as targets, T = seq_len.
`retokenize` re-expresses a byte dataset in another tokenizer's ids: an imported model's
tokenizer.json, which every workdir derived from it carries, so that training, uptraining and
evaluation all see the corpus in that model's own token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import sysconfig
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kvjax.training.config import HELD_OUT_RULES, DataConfig

VOCAB_SIZE = 256
# Directories of the standard library that are not the library itself, and pydoc_data, whose
# documentation text is held out of pre-training for the GQA table's prose task (kvjax.studies.base.tasks).
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "pydoc_data"})
PROSE = "prose"
# The documentation's split: blocks of whole paragraphs of about HELD_OUT_BLOCK bytes, every
# HELD_OUT_EVERY-th held out, so that both parts cover every topic.
DOC_BLOCK, DOC_HELD_OUT_EVERY = 2048, 5


def paragraphs_of(text: str) -> list[str]:
  """The paragraphs of `text`: what blank lines separate, without the newlines at either end."""
  return [p.strip("\n") for p in re.split(r"\n(?:[ \t]*\n)+", text) if p.strip()]


@functools.cache
def documentation() -> tuple[bytes, bytes]:
  """(train, held-out) UTF-8 bytes of pydoc_data.topics: the distinct paragraphs of the topics in
  key order, grouped into blocks of about DOC_BLOCK bytes, every DOC_HELD_OUT_EVERY-th held out."""
  from pydoc_data.topics import topics

  parts, block, index, seen = ([], []), [], 0, set()
  for key in sorted(topics):
    # Topics repeat one another verbatim ("compound" holds "if", "try", ...): each paragraph is
    # kept once, where it first occurs, so that no paragraph lands in both parts.
    paragraphs = [p for p in dict.fromkeys(paragraphs_of(topics[key])) if p not in seen]
    seen.update(paragraphs)
    for i, paragraph in enumerate(paragraphs):
      block.append(paragraph)
      if sum(map(len, block)) >= DOC_BLOCK or i == len(paragraphs) - 1:
        parts[index % DOC_HELD_OUT_EVERY == DOC_HELD_OUT_EVERY - 1].append("\n\n".join(block))
        block, index = [], index + 1
  return tuple("\n\n".join(part).encode() for part in parts)


def encode(text: str) -> np.ndarray:
  """str -> int32 [len(utf-8 bytes)]."""
  return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(tokens) -> str:
  """Byte ids -> str; bytes that are not valid UTF-8 (a cut multi-byte character) become U+FFFD."""
  ids = np.asarray(tokens, np.int64).reshape(-1)
  if ((ids < 0) | (ids >= VOCAB_SIZE)).any():
    bad = int(ids[(ids < 0) | (ids >= VOCAB_SIZE)][0])
    raise ValueError(f"token id {bad} is not a byte (0..255)")
  return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
  source: str  # "stdlib" or the resolved path
  root: str  # directory the files were read from
  num_files: int
  num_bytes: int
  sha256: str

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def corpus_files(source: str) -> tuple[Path, list[Path]]:
  """(root, files in read order) for a DataConfig.source."""
  if source == "stdlib":
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
      dirs[:] = [d for d in dirs if d not in STDLIB_SKIP]
      files += [Path(folder, n) for n in names if n.endswith(".py")]
  else:
    root = Path(source).expanduser().resolve()
    if root.is_file():
      return root.parent, [root]
    if not root.is_dir():
      raise ValueError(f"DataConfig.source: no such file or directory: {root}")
    files = [
      p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
  files.sort(key=lambda p: p.relative_to(root).as_posix())
  if not files:
    raise ValueError(f"DataConfig.source: no files found under {root}")
  return root, files


def load_corpus(config: DataConfig) -> tuple[np.ndarray, CorpusInfo]:
  """Reads the corpus -> (uint8 [N] bytes, info). N <= config.max_bytes."""
  root, files = corpus_files(config.source)
  chunks, size, used = [], 0, 0
  for path in files:
    if size >= config.max_bytes:
      break
    try:
      chunk = path.read_bytes()[: config.max_bytes - size]
    except OSError as err:
      raise ValueError(f"cannot read corpus file {path}: {err}") from err
    chunks.append(chunk)
    size += len(chunk)
    used += 1
  data = b"".join(chunks)
  if not data:
    raise ValueError(f"DataConfig.source: the corpus {config.source} is empty ({used} file(s) of 0 bytes under {root})")
  info = CorpusInfo(
    source=config.source if config.source == "stdlib" else str(Path(config.source).resolve()),
    root=str(root),
    num_files=used,
    num_bytes=len(data),
    sha256=hashlib.sha256(data).hexdigest(),
  )
  return np.frombuffer(data, np.uint8), info


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A corpus split into train and held-out tokens [N] (see `held_out_mask`).
  With the byte tokenizer the splits are the corpus bytes (uint8) and bytes_per_token is 1."""

  train: np.ndarray
  val: np.ndarray
  seq_len: int
  info: CorpusInfo
  bytes_per_token: float = 1.0


# Held-out blocks are at most this many bytes.
HELD_OUT_BLOCK = 1 << 14


def held_out_mask(num_bytes: int, val_fraction: float, rule: str = "spread") -> np.ndarray:
  """bool [num_bytes], True for held-out bytes: val_fraction of the corpus.

  "spread": blocks of up to 16 KiB (at least 64 blocks in all) spread evenly over the corpus. A
  held-out tail samples one corner of a sorted corpus; the standard library's ends in codec
  tables, almost pure copying.
  "tail": the last bytes, for a corpus in time order.
  """
  if rule not in HELD_OUT_RULES:
    raise ValueError(f"held-out rule must be {' or '.join(map(repr, HELD_OUT_RULES))}, got {rule!r}")
  if rule == "tail":
    return np.arange(num_bytes) >= num_bytes - max(1, round(num_bytes * val_fraction))
  block = min(HELD_OUT_BLOCK, max(1, num_bytes // 64))
  num_blocks = -(-num_bytes // block)
  num_held = max(1, round(num_blocks * val_fraction))
  held = np.zeros(num_blocks, bool)
  held[((np.arange(num_held) + 0.5) * num_blocks / num_held).astype(np.int64)] = True
  return np.repeat(held, block)[:num_bytes]


def load_dataset(config: DataConfig, tokenizer=None) -> Dataset:
  """The corpus of `config` split into train and held-out bytes, or, given a tokenizer (a
  workdir's, kvjax.interop.tokenizer.TextTokenizer), that tokenizer's ids of them."""
  if config.source == PROSE:  # the documentation's own split; max_bytes, val_fraction, held_out do not apply
    train, val = documentation()
    info = CorpusInfo(
      source=PROSE,
      root="pydoc_data.topics",
      num_files=1,
      num_bytes=len(train) + len(val),
      sha256=hashlib.sha256(train + val).hexdigest(),
    )
    train, val = np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8)
  else:
    corpus, info = load_corpus(config)
    held = held_out_mask(len(corpus), config.val_fraction, config.held_out)
    train, val = corpus[~held], corpus[held]
  need = config.seq_len + 1
  if tokenizer is None and min(len(train), len(val)) < need:
    raise ValueError(
      f"corpus {info.source} has {len(train) + len(val)} bytes: too small for windows of seq_len + 1 = "
      f"{need} bytes in both the train split ({len(train)}) and the held-out split ({len(val)}); use a "
      "larger corpus, max_bytes or val_fraction, or a smaller seq_len"
    )
  dataset = Dataset(train=train, val=val, seq_len=config.seq_len, info=info)
  return dataset if tokenizer is None else retokenize(dataset, tokenizer.encode)


def retokenize(dataset: Dataset, encode: Callable[[str], Sequence[int]]) -> Dataset:
  """The byte dataset's splits as ids of another tokenizer (e.g. an imported model's).

  bytes_per_token becomes the held-out split's bytes per token, the usual normalisation for
  reporting such a model's loss in bits per byte.
  """

  def ids(split: np.ndarray) -> np.ndarray:
    return np.asarray(encode(split.tobytes().decode("utf-8", errors="replace")), np.int32)

  train, val = ids(dataset.train), ids(dataset.val)
  if min(len(train), len(val)) < dataset.seq_len + 1:
    raise ValueError(
      f"corpus {dataset.info.source} gives {len(train)} train and {len(val)} held-out tokens: "
      f"too few for windows of seq_len + 1 = {dataset.seq_len + 1} tokens"
    )
  return dataclasses.replace(dataset, train=train, val=val, bytes_per_token=len(dataset.val) / len(val))


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Windows of seq_len + 1 bytes at `starts` [B] -> (inputs, targets) int32 [B, seq_len]."""
  rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)  # [B, T + 1]
  return rows[:, :-1], rows[:, 1:]


class WindowSampler:
  """Random training windows from a seeded numpy generator.

  `state()` (batches drawn so far and the generator state) goes into every checkpoint;
  `restore(state)` continues the exact sequence a run would have drawn without interruption.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
    self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
    self.rng = np.random.Generator(np.random.PCG64(seed))
    self.position = 0

  def next(self) -> tuple[np.ndarray, np.ndarray]:
    starts = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
    self.position += 1
    return windows(self.tokens, starts, self.seq_len)

  def state(self) -> dict:
    return {"position": self.position, "rng": self.rng.bit_generator.state}

  def restore(self, state: dict) -> None:
    self.position = int(state["position"])
    self.rng.bit_generator.state = state["rng"]


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int):
  """Yields num_batches fixed (inputs, targets) batches: windows spread evenly over `tokens`,
  the same every call, so evaluations at different steps are comparable."""
  count = batch_size * num_batches
  starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
  for i in range(num_batches):
    yield windows(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len)
