"""The RULER-style suite's samples and answers, below the jobs that use them (kvjax.studies.ruler,
press_table, and the suite of the real-model studies, kvjax.studies.suite.axis): the samples of every
task of kvjax.studies.suite.ruler_tasks at each context length, answered greedily through the KV cache
of a CacheConfig (one at a time, `answer`, or many from one prefill, `answer_cells`) and scored
as RULER scores them.

Scoring (RULER's scripts/eval/synthetic/constants.py): string_match_all, the fraction of a
sample's references found in its answer (case-insensitive; kvjax.studies.base.scoring.score, which
the pass-key test shares), for every task here (RULER's string_match_part is for its
question-answering tasks, which need datasets kvjax does not download). A task's score is the
mean over its samples, in percent; the suite's is the mean over tasks.

Protocols (kvjax.studies.base.measure.PROTOCOLS):
  query_agnostic  kvpress's: context_ids are prefilled (and pressed) first, question_ids read
                  after into what the cache kept;
  query_aware     the whole prompt in one generate (a press sees the question).
Samples of one task and length are answered batch_size at a time (query-agnostic: the contexts
and the questions each right-padded, read with their own lengths).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache import kinds
from kvjax.cache.base import size_bucket
from kvjax.cache.config import CacheConfig, cache_name
from kvjax.decoding import many
from kvjax.fields import check_positive_int
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.studies.base import measure
from kvjax.studies.base.measure import PROTOCOLS
from kvjax.studies.base.models import tokenized_model
from kvjax.studies.suite.ruler_prompts import TEMPLATES
from kvjax.studies.suite.ruler_tasks import check_tasks, make_sample
from kvjax.studies.base.scoring import LineEnd, check_answer_end, first_line, score

FACTS = ("depth", "distance")


def check_lengths(lengths) -> tuple[int, ...]:
  lengths = tuple(lengths)
  if not lengths:
    raise ValueError("RULER lengths must be a non-empty tuple of token counts")
  for i, length in enumerate(lengths):
    check_positive_int(length, f"RULER lengths[{i}]")
  return lengths


def build(
  tokenizer: TextTokenizer,
  tasks: Iterable[str],
  lengths: Iterable[int],
  samples: int,
  *,
  seed: int = 0,
  template: str = "auto",
  max_len: int | None = None,
) -> list[dict]:
  """`samples` samples of every task at every length (ruler_tasks.make_sample). With max_len (the
  positions the model holds): a length whose prompt and answer budget exceed it is refused first."""
  tasks, lengths = check_tasks(tasks), check_lengths(lengths)
  check_positive_int(samples, "RULER samples")
  if template not in TEMPLATES:
    raise ValueError(f"RULER template must be one of {TEMPLATES}, got {template!r}")
  if max_len is not None:
    for length in lengths:
      if length > max_len:
        raise ValueError(f"RULER length {length} is more than the model's max_len={max_len} positions")
  out = []
  for length in lengths:
    for task in tasks:
      for index in range(samples):
        s = make_sample(tokenizer, task, length, index, seed=seed, template=template)
        if max_len is not None and length + s["answer_tokens"] > max_len:
          raise ValueError(
            f"RULER length {length} and task {task}'s {s['answer_tokens']} answer tokens need "
            f"{length + s['answer_tokens']} positions, more than the model's max_len={max_len}"
          )
        out.append(s)
  return out


def answer(
  model: Transformer,
  params,
  tokenizer: TextTokenizer,
  samples: list[dict],
  cache_config: CacheConfig = CacheConfig(),
  *,
  protocol: str = "query_agnostic",
  batch_size: int = 8,
  end: str = "budget",
  progress: Callable[[str], None] = lambda message: None,
) -> list[dict]:
  """Greedy answers of every sample through caches of cache_config -> one result per sample
  (id, task, length, method, answer, score, and the sample's depth / distance). end: where an
  answer ends besides a stop id, "budget" or "line" (kvjax.studies.base.scoring)."""
  if protocol not in PROTOCOLS:
    raise ValueError(f"RULER protocol must be one of {PROTOCOLS}, got {protocol!r}")
  check_answer_end(end)
  method = cache_name(cache_config)
  cache_config = cache_config.bind(tokenizer)
  groups: dict[tuple, list[dict]] = {}
  for s in samples:
    groups.setdefault((s["task"], s["length"]), []).append(s)
  results = {}
  for (task, length), group in groups.items():
    progress(f"ruler: {task} at {length} tokens, {len(group)} samples, {method}")
    budget = max(s["answer_tokens"] for s in group)
    for start in range(0, len(group), batch_size):
      batch = group[start : start + batch_size]
      prompts, lengths, asked = measure.protocol_inputs(
        protocol, [s["context_ids"] for s in batch], [s["question_ids"] for s in batch]
      )
      got = measure.answers(model, params, prompts, lengths, budget, cache_config, stop_ids=tokenizer.stop_ids, **asked)
      for s, ids in zip(batch, got):
        results[s["id"]] = record(s, method, answer_text(tokenizer, ids, s["answer_tokens"], end))
  return [results[s["id"]] for s in samples]


def answer_cells(
  model: Transformer,
  params,
  tokenizer: TextTokenizer,
  sample: dict,
  cache_configs: list[CacheConfig],
  *,
  protocol: str = "query_agnostic",
  end: str = "budget",
  memory_limit: int | None = None,
) -> list[dict]:
  """Greedy answers of one sample through a cache of each of cache_configs, as `answer` gives
  them cell by cell, from one prefill (kvjax.decoding.many.prefill_many: every press scores once,
  each ratio a cut of its scores) and one batch of answers (answer_many, a row stopped where its
  answer ends) -> one result per config, in order. The configs are taken in consecutive parts
  whose caches hold at most `memory_limit` bytes together (default `cache_memory()`; `cell_parts`),
  a prefill and a batch of answers per part, so that many caches of a long prompt fit in memory."""
  if protocol not in PROTOCOLS:
    raise ValueError(f"RULER protocol must be one of {PROTOCOLS}, got {protocol!r}")
  check_answer_end(end)
  until = line_end(tokenizer) if end == "line" else None
  configs = [c.bind(tokenizer) for c in cache_configs]
  context, question = sample["context_ids"], sample["question_ids"]
  budget = sample["answer_tokens"]
  max_len = len(context) + len(question) + budget
  tokens, lengths, asked = measure.protocol_inputs(protocol, [context], [question])
  got = []
  limit = cache_memory() if memory_limit is None else memory_limit
  # Parts sized at the bucketed lengths the caches are made at: samples of one length part alike,
  # so each part's prefill and answers compile once for the whole table.
  room = max(model.config.max_positions, max_len)
  sized = (size_bucket(max_len, room), size_bucket(tokens.shape[1], room))
  for part in cell_parts(model.config, configs, *sized, limit):
    prefilled = many.prefill_many(model, params, tokens, lengths, max_len, part)
    if protocol == "query_aware":
      asked = {"first": [np.asarray(jnp.argmax(logits, axis=-1)) for logits, _ in prefilled]}
    caches = [c for _, c in prefilled]
    del prefilled
    got += many.answer_many(model, params, caches, budget, stop_ids=tokenizer.stop_ids, until=until, **asked)
    del caches  # before the next part's prefill
    memory.release_free()  # what the part freed goes back to the system (kvjax.memory.release_free)
  return [
    record(sample, cache_name(config), answer_text(tokenizer, ids, budget, end))
    for config, (ids,) in zip(cache_configs, got)
  ]


# The share of free memory one part of answer_cells' caches may take. Measured on SmolLM2 at 2,048
# tokens, 24 cells (1.2 GiB of caches): the shared prefill peaks at 3.1x its caches' bytes and the
# batch of answers (the caches stacked, the question read into them) at 6.5x, so a part of free /
# 24 peaks near a quarter of free memory.
CACHE_MEMORY_SHARE = 24
CACHE_MEMORY_FLOOR = 2**28  # 256 MiB where free memory is unknown or small


@functools.cache
def cache_memory() -> int:
  """Bytes of caches one part of answer_cells holds: free memory / CACHE_MEMORY_SHARE, taken once
  per process (free memory moves from sample to sample; parts that moved with it would compile
  new shapes for every sample)."""
  free = memory.available_bytes()
  return max(CACHE_MEMORY_FLOOR, (free or 0) // CACHE_MEMORY_SHARE)


def cell_parts(config, configs: list[CacheConfig], max_len: int, prompt: int, limit: int) -> list[list[CacheConfig]]:
  """configs in consecutive parts whose caches (kinds.cache_bytes of one row) add up to at most
  `limit` bytes. Consecutive configs of one press's scoring (Press.scoring: its ratios, budgets and
  codecs, which one prefill scores once) stay in one part unless together they pass the limit;
  a config over the limit alone is a part of its own."""
  groups: list[tuple[object, list[CacheConfig]]] = []
  for c in configs:
    key = None if c.press is None else c.press.scoring
    if groups and key is not None and groups[-1][0] == key:
      groups[-1][1].append(c)
    else:
      groups.append((key, [c]))
  parts: list[list[CacheConfig]] = []
  held = 0
  for _, group in groups:
    sizes = [kinds.cache_bytes(config, c, 1, max_len, prompt=prompt) for c in group]
    if parts and held + sum(sizes) > limit and sum(sizes) <= limit:  # the whole group in a part of its own
      parts.append([])
      held = 0
    for c, size in zip(group, sizes):  # a group over the limit is cut where it must be
      if not parts or held + size > limit:
        parts.append([])
        held = 0
      parts[-1].append(c)
      held += size
  return parts


def answer_text(tokenizer: TextTokenizer, ids, budget: int, end: str) -> str:
  """The text of an answer's first `budget` ids, cut at its first line for end="line"."""
  text = tokenizer.decode(np.asarray(ids)[:budget], skip_special_tokens=True)
  return first_line(text) if end == "line" else text


@functools.lru_cache(maxsize=4)
def line_end(tokenizer: TextTokenizer) -> LineEnd:
  """The LineEnd stop test of a tokenizer, made once (it reads every token's text)."""
  return LineEnd(tokenizer)


def record(sample: dict, method: str, answer: str) -> dict:
  """The one per-sample record of an answer: the sample's id, task, length, depth / distance, the
  cache's name (kvjax.cache.cache_name), the answer and its score."""
  return {
    "id": sample["id"],
    "task": sample["task"],
    "length": sample["length"],
    "method": method,
    "answer": answer,
    "score": score(answer, sample["references"]),
    **{k: sample[k] for k in FACTS if k in sample},
  }


def summary(results: list[dict]) -> dict:
  """Scores in percent: {"tasks": {length: {task: score}}, "lengths": {length: the mean over tasks},
  "overall": the mean over every (length, task)}."""
  by: dict[int, dict[str, list[float]]] = {}
  for r in results:
    by.setdefault(r["length"], {}).setdefault(r["task"], []).append(r["score"])
  tasks = {str(n): {t: round(100 * float(np.mean(v)), 2) for t, v in per.items()} for n, per in by.items()}
  lengths = {n: round(float(np.mean(list(per.values()))), 2) for n, per in tasks.items()}
  cells = [v for per in tasks.values() for v in per.values()]
  return {"tasks": tasks, "lengths": lengths, "overall": round(float(np.mean(cells)), 2) if cells else None}


NEEDS = "the RULER suite is for tokenized models (an imported one)"


def load(source: str):
  """(model, params, tokenizer, a name for reports) of a named model, a file, a directory or a
  kvjax workdir with a checkpoint; ValueError when it has no tokenizer."""
  return tokenized_model(source, needs=NEEDS)
