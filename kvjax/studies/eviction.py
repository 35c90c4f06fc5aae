"""The eviction study: needle recall and perplexity of a pretrained model decoded through evicting
caches (kvjax.cache.evict), one press and compression ratio at a time, beside the full cache.

Needle recall follows kvpress's protocol: prompts of exactly `context` tokens of held-out prose
(kvjax.studies.passkey's pass-key prompt: the instruction, a 5-digit key sentence at a random
depth, whole sentences of prose), then the question in the chat template; greedy answers scored
by exact match. Two protocols:
  query_agnostic  the context is pressed before the question arrives (kvpress's pipeline; a
                  cache shared by many questions must be): prefill the context through the
                  press, then extend the question into the evicted cache and decode;
  query_aware     the question is inside the pressed prompt (SnapKV's setting): generate from
                  the whole prompt through the press.
Perplexity: held-out prose windows of perplexity_context + continuation tokens; the context is
pressed, then the continuation is read through the evicted cache and scored (the tokens the
prefill's own logits predict are left out: no press changes them).

Run: kvjax run configs/eviction/smollm2.py --workdir runs/eviction
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import PRESSES, make_press
from kvjax.decoding import decode
from kvjax.fields import check_positive, check_nonnegative
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.studies import report
from kvjax.studies.real_kv import continuation_nll
from kvjax.studies.passkey import Frame, PasskeyConfig, Prose, answered, answers, examples
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset

PROTOCOLS = ("query_agnostic", "query_aware")


@dataclasses.dataclass(frozen=True)
class EvictionStudy:
  """source: the pretrained model (a name kvjax import knows, or a file). presses x ratios for
  perplexity, presses x recall_ratios x PROTOCOLS for recall; `trials` needles per cell."""

  source: str = "smollm2-135m"
  presses: tuple[str, ...] = tuple(PRESSES)
  ratios: tuple[float, ...] = (0.5, 0.75, 0.875)
  recall_ratios: tuple[float, ...] = (0.75,)
  trials: int = 24
  context: int = 950
  answer_tokens: int = 10
  batch_size: int = 8
  perplexity_context: int = 1024
  continuation: int = 256
  windows: int = 4
  seed: int = 0
  job: str = "eviction"

  def __post_init__(self):
    if self.job != "eviction":
      raise ValueError(f"EvictionStudy.job must be 'eviction', got {self.job!r}")
    check_positive(self, "trials", "context", "answer_tokens", "batch_size", "perplexity_context", "continuation")
    check_nonnegative(self, "windows", "seed")
    if self.context < 128:
      raise ValueError(
        f"EvictionStudy.context must be at least 128 tokens (a needle at a random depth), got {self.context}"
      )
    for press in self.presses:
      if press not in PRESSES:
        raise ValueError(f"EvictionStudy.presses: {press!r} is not one of {tuple(PRESSES)}")
    for name in ("ratios", "recall_ratios"):
      for ratio in getattr(self, name):
        make_press("knorm", compression_ratio=ratio)  # a ratio outside [0, 1) is refused, named


def needles(tokenizer, study: EvictionStudy):
  """study.trials prompts -> (contexts int32 [n, context], question int32 [q], keys): the needle
  sentence at a random depth of exactly `context` tokens, the question (the frame's closing) after."""
  frame = Frame.of(tokenizer)
  prose = Prose.of(tokenizer)
  rng = np.random.default_rng([study.seed, study.context])
  rows, keys = [], []
  while len(rows) < study.trials:
    total = study.context + len(frame.closing)
    distance = int(rng.integers(len(frame.closing) + 24, study.context - 32))
    lead = total - distance - len(frame.opening) - len(frame.separator)
    config = PasskeyConfig(distances=(distance,), needles=1, lead=lead, seed=int(rng.integers(2**31)))
    try:
      prompts, lengths, found = examples(tokenizer, config, distance, prose)
    except ValueError:  # no run of whole sentences of exactly that many tokens: draw another depth
      continue
    rows.append(prompts[0, : study.context])
    keys.append(found[0])
  return np.stack(rows).astype(np.int32), frame.closing.astype(np.int32), keys


def greedy_after(model, params, cache, question: np.ndarray, new_tokens: int, stop_ids) -> np.ndarray:
  """Extends every row of `cache` by `question` [q], then greedy-decodes new_tokens -> int32 [B, new_tokens]."""
  batch = cache.lengths.shape[0]
  tokens = np.broadcast_to(question, (batch, len(question)))
  logits, cache = decode.extend(model, params, cache, tokens, np.full(batch, len(question)), logits="last")
  out = [np.asarray(jnp.argmax(logits, axis=-1), np.int32)]
  while len(out) < new_tokens and not np.isin(np.stack(out, 1), stop_ids).any(axis=1).all():
    logits, cache = decode.decode_step(model, params, cache, out[-1])
    out.append(np.asarray(jnp.argmax(logits, axis=-1), np.int32))
  return np.stack(out, 1)


def recall(model, params, tokenizer, cache_config: CacheConfig, protocol: str, trials, study: EvictionStudy) -> float:
  """Exact-match recall (%) of the needles `trials` (needles()) through caches of cache_config."""
  contexts, question, keys = trials
  hits = []
  for start in range(0, len(contexts), study.batch_size):
    rows = contexts[start : start + study.batch_size]
    n, c = rows.shape
    max_len = c + len(question) + study.answer_tokens
    if protocol == "query_aware":
      prompts = np.concatenate([rows, np.broadcast_to(question, (n, len(question)))], axis=1)
      lengths = np.full(n, prompts.shape[1], np.int32)
      out = answers(model, params, prompts, lengths, study.answer_tokens, tokenizer.stop_ids, cache_config=cache_config)
    else:
      _, cache = decode.prefill(model, params, rows, np.full(n, c), max_len, logits="last", cache_config=cache_config)
      out = decode.until_stop(
        greedy_after(model, params, cache, question, study.answer_tokens, tokenizer.stop_ids), tokenizer.stop_ids
      )
    hits += [answered(tokenizer.decode(row), key) for row, key in zip(out, keys[start : start + study.batch_size])]
  return 100.0 * float(np.mean(hits))


def perplexity(model, params, windows, cache_config: CacheConfig, study: EvictionStudy) -> float:
  """Perplexity of the continuations of `windows` ([(inputs, targets)] of context + continuation
  tokens) read through a cache of cache_config that pressed their contexts."""
  total, count = continuation_nll(model, params, windows, cache_config, study.perplexity_context)
  return math.exp(total / count)


def run_study(study: EvictionStudy, workdir: str | Path, progress=print) -> list[dict]:
  """Every cell of the study -> rows {press, ratio, perplexity, recall_query_agnostic,
  recall_query_aware}; writes eviction.{csv,json,md} to workdir."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  params, config, tokenizer, path = read_model(study.source)
  if tokenizer is None:
    raise ValueError(f"EvictionStudy.source={study.source!r} has no tokenizer; the needles need one")
  model = Transformer(config)
  trials = needles(tokenizer, study)
  data = load_dataset(DataConfig(source=PROSE, seq_len=study.perplexity_context + study.continuation), tokenizer)
  windows = list(eval_batches(data.val, study.perplexity_context + study.continuation, study.windows, 1))
  rows = []
  for press, ratio in [(None, 0.0)] + [
    (p, r) for p in study.presses for r in sorted({*study.ratios, *study.recall_ratios})
  ]:
    cache_config = CacheConfig(press=None if press is None else make_press(press, compression_ratio=ratio))
    row = {"press": press or "full cache", "ratio": ratio}
    if press is None or ratio in study.ratios:
      row["perplexity"] = perplexity(model, params, windows, cache_config, study) if study.windows else None
    if press is None or ratio in study.recall_ratios:
      for protocol in PROTOCOLS:
        row[f"recall_{protocol}"] = recall(model, params, tokenizer, cache_config, protocol, trials, study)
    rows.append(row)
    progress(json.dumps(row))
  columns = [
    ("press", "press", ""),
    ("ratio", "compression ratio", ".3f"),
    ("perplexity", "perplexity", ".3f"),
    ("recall_query_agnostic", "recall %, query-agnostic", ".1f"),
    ("recall_query_aware", "recall %, query-aware", ".1f"),
  ]
  table = report.write_table(rows, workdir / "eviction", columns)
  (workdir / "eviction.md").write_text(
    f"Eviction study: {path.name}, {study.trials} needles of {study.context} tokens, "
    f"{study.windows} windows of {study.perplexity_context} + {study.continuation} tokens\n\n{table}\n"
  )
  return rows
