"""Long-range recall: can a model copy a random byte string (a needle) from D bytes back?

Each example is one line planting the needle, filler text, and the same marker again:

    NEEDLE = "<needle>"\\n<filler ...>\\nNEEDLE = "

so the continuation is the needle: induction-style copying, which a byte-level model trained on
Python sources learns (every repeated name is such a copy). The needle is `needle_bytes` random
ASCII letters and digits; the filler is a window of the held-out corpus (kvjax.training.data's
split of the run's DataConfig, the standard library by default), so the model reads text like
its training text between the needle and the question.

The distance D is the number of positions from the needle's first byte to the prompt's last
byte. Answer byte j is predicted at position (prompt end + j), where the needle's byte j lies
exactly D positions back: a sliding window must span D + 1 positions (the query's own included)
to see it. So D >= MIN_DISTANCE + needle_bytes (the marker, the needle and its closing quote).

Scoring is greedy decoding through the KV cache (kvjax.studies.base.measure.recall), so what the
model reads is what the cache kind stores: a quantized cache's rounding, a window's forgetting.
Per distance: byte accuracy (answer bytes equal to the needle's, position by position) and exact
match (whole needles), both in [0, 1]. Everything is drawn from a generator seeded by
(seed, D): the same config gives the same examples for every model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.fields import check_nonnegative, check_positive, check_positive_int, from_dict
from kvjax.interop.hf_files import TOKENIZER_FILE
from kvjax.model.transformer import Transformer
from kvjax.studies.base import measure
from kvjax.training.checkpoint import latest_step, load_model
from kvjax.training.config import DataConfig
from kvjax.training.data import load_dataset

MARKER = b'NEEDLE = "'
CLOSE = b'"\n'
SEPARATOR = b"\n"
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", np.uint8)
# Positions from the needle's first byte to the prompt's end that are not needle or filler.
MIN_DISTANCE = len(CLOSE) + len(SEPARATOR) + len(MARKER) - 1


@dataclasses.dataclass(frozen=True)
class RecallConfig:
  """`needles` examples at each distance in `distances` (bytes; see the module docstring)."""

  distances: tuple[int, ...] = (32, 64, 96)
  needles: int = 16
  needle_bytes: int = 12
  seed: int = 0

  def __post_init__(self):
    check_positive(self, "needles", "needle_bytes")
    check_nonnegative(self, "seed")
    if not isinstance(self.distances, tuple) or not self.distances:
      raise ValueError(f"RecallConfig.distances must be a non-empty tuple of distances, got {self.distances!r}")
    for i, distance in enumerate(self.distances):
      check_positive_int(distance, f"RecallConfig.distances[{i}]")
      if distance < self.min_distance:
        raise ValueError(
          f"RecallConfig.distances[{i}]={distance} is below {self.min_distance}: the marker, a "
          f"needle of {self.needle_bytes} bytes and its closing quote take that many positions"
        )
    if len(set(self.distances)) != len(self.distances):
      raise ValueError(f"RecallConfig.distances must be distinct, got {self.distances!r}")

  @property
  def min_distance(self) -> int:
    return MIN_DISTANCE + self.needle_bytes

  def positions(self, distance: int) -> int:
    """Cache positions one example at `distance` needs: its prompt and all but the last answer byte."""
    return len(MARKER) + distance + 1 + self.needle_bytes - 1

  def check_model(self, max_len: int, vocab_size: int) -> None:
    """Refuses a model whose vocabulary is not bytes or whose positions do not hold the longest example."""
    if vocab_size < 256:
      raise ValueError(
        f"ModelConfig.vocab_size={vocab_size}: the recall test is byte-level and needs a vocabulary of at least 256"
      )
    longest = max(self.distances)
    if self.positions(longest) > max_len:
      raise ValueError(
        f"RecallConfig.distances: distance {longest} needs {self.positions(longest)} positions, "
        f"more than ModelConfig.max_len={max_len}"
      )


def examples(config: RecallConfig, distance: int, filler: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The examples at one distance -> (prompts int32 [n, P], needles int32 [n, needle_bytes]), all
  prompts of the same length P. `filler` is the text (uint8 [N]) filler windows are cut from;
  a window holding the marker is drawn again."""
  if distance < config.min_distance:
    raise ValueError(f"distance {distance} is below RecallConfig.min_distance={config.min_distance}")
  size = distance - config.min_distance
  if len(filler) < size + 1:
    raise ValueError(f"the filler text has {len(filler)} bytes, fewer than distance {distance} needs ({size + 1})")
  rng = np.random.default_rng([config.seed, distance])
  prompts, needles = [], []
  while len(prompts) < config.needles:
    needle = ALPHABET[rng.integers(len(ALPHABET), size=config.needle_bytes)].tobytes()
    start = int(rng.integers(len(filler) - size + 1))
    prompt = MARKER + needle + CLOSE + filler[start : start + size].tobytes() + SEPARATOR + MARKER
    if prompt.count(MARKER) == 2:  # the filler must not plant a marker of its own
      prompts.append(prompt)
      needles.append(needle)
  as_ids = lambda items: np.stack([np.frombuffer(x, np.uint8) for x in items]).astype(np.int32)
  return as_ids(prompts), as_ids(needles)


def recall(
  model: Transformer, params, config: RecallConfig, filler: np.ndarray, cache_config: CacheConfig = CacheConfig()
) -> dict[str, dict]:
  """Greedy copies of the needles at every distance through a cache of `cache_config`
  (kvjax.studies.base.measure.recall, one batch per distance) -> {str(D): {"distance",
  "byte_accuracy", "exact_match", "needles", "samples"}}; samples: one record per needle
  ({"index", "needle", "answer", "byte_accuracy", "hit"}, text as str)."""
  config.check_model(model.config.max_len, model.config.vocab_size)
  out = {}
  for distance in config.distances:
    prompts, needles = examples(config, distance, filler)
    lengths = np.full((len(prompts),), prompts.shape[1], np.int32)
    exact, samples = measure.recall(model, params, prompts, lengths, needles, judge, config.needle_bytes, cache_config)
    out[str(distance)] = {
      "distance": distance,
      "byte_accuracy": float(np.mean([s["byte_accuracy"] for s in samples])),
      "exact_match": exact,
      "needles": config.needles,
      "samples": samples,
    }
  return out


def judge(copy: np.ndarray, needle: np.ndarray) -> dict:
  """One sample's record: the needle and the copy as text, the fraction of bytes in place, and
  whether the whole needle was copied."""
  text = lambda ids: np.asarray(ids, np.uint8).tobytes().decode("latin-1")
  hits = score(copy[None], needle[None])
  return {
    "needle": text(needle),
    "answer": text(copy),
    "byte_accuracy": hits["byte_accuracy"],
    "hit": bool(hits["exact_match"]),
  }


def score(copies, needles: np.ndarray) -> dict[str, float]:
  """copies, needles int [n, needle_bytes] -> {"byte_accuracy": the fraction of bytes equal to the
  needle's at their position, "exact_match": the fraction of whole needles copied}."""
  hits = np.asarray(copies) == needles  # [n, needle_bytes]
  return {"byte_accuracy": float(hits.mean()), "exact_match": float(hits.all(axis=1).mean())}


def recall_checkpoint(workdir: str | Path, config: RecallConfig, *, step: int | None = None) -> dict:
  """`recall` of a workdir's checkpoint (latest unless `step`), filler from the held-out split of
  its run's corpus. A workdir with its own tokenizer (an imported model) is refused: the test is
  written in bytes."""
  if (Path(workdir) / TOKENIZER_FILE).exists():
    raise ValueError(
      f"{workdir} holds a {TOKENIZER_FILE}: its model reads that tokenizer's ids, and the "
      "recall test is written in bytes"
    )
  step = latest_step(workdir) if step is None else step
  model, params, run_config = load_model(workdir, step)
  config.check_model(model.config.max_len, model.config.vocab_size)
  data = load_dataset(
    from_dict(DataConfig, run_config["data"])
    if "data" in run_config
    else DataConfig(seq_len=min(128, model.config.max_len))
  )
  return {
    "step": step,
    "needle_bytes": config.needle_bytes,
    "seed": config.seed,
    "corpus": data.info.source,
    "recall": recall(model, params, config, data.val),
  }
