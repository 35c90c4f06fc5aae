"""One prefill, many caches; many caches' answers in one batch.

prefill_many(model, params, tokens, lengths, max_len, cache_configs) returns, for each cache
config, the (logits, cache) that `prefill` with that config returns, array for array, but runs
the model once for all the configs that can share a prefill (kvjax.cache.layouts.fanout): a press
compresses what a layer stores after the layer has attended over the whole prompt, so the
prompt's hidden states are those of the full cache whatever the press; presses differing only in
ratio or budget (AdaKV heads, pyramid layers) score each layer once; KVzip's reconstruction runs
once for all its ratios and head shares (kvjax.cache.kvzip.reconstruct). One prefill is shared
by configs whose prompt reads back alike: one per codec and rotation (a press with dtype="int8"
shares with the int8 full cache, not with float32). A config that prefills on its own, through
`prefill`: a press with a chunked prefill under a budget (prefill_chunk: each chunk reads the
row's own pressed cache), and the layouts that do not press (paged, KIVI).

answer_many(model, params, caches, ...) decodes greedy answers of many prefilled caches
(contiguous or evicting, one codec) in one batch (kvjax.cache.layouts.stack): the question, for the
query-agnostic protocol, read into every row by one extend; then decode steps of every row still
answering. A row stops at a stop id, its budget or when `until` says its answer has ended;
once half the batch has stopped, the rows left are taken into a smaller batch, so a step costs
what its running rows cost. Batches are sized up to a multiple of 8 (powers of two below 8) and
slots to a multiple of 256, which bounds the compilations. Evicting rows whose heads hold uneven
numbers of tokens (AdaKV, KVzip) decode in a batch of their own, read by positions, the others
through the contiguous decode route, each as its own cache would be read.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kinds

from kvjax.cache.layouts import stack as stacking
from kvjax.cache.base import size_bucket
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.fanout import Fanout, shares_prefill
from kvjax.cache import kvzip
from kvjax.cache.kvzip import KVzip
from kvjax.decoding import decode
from kvjax.fields import check_positive_int
from kvjax.model.transformer import Transformer, apply_cached

SHARED = ("contiguous", "evict")  # the layouts a shared prefill fills
SLOTS = 256  # a stacked batch's slots are a multiple of this: few shapes, little padding to copy


def _shares(cache_config: CacheConfig) -> bool:
  return cache_config.layout in SHARED and not cache_config.prefill_chunk


@functools.partial(jax.jit, static_argnames=("model", "last"))
def _fanout_prefill(model: Transformer, params, fan: Fanout, tokens, lengths, last: bool):
  logits_at = jnp.maximum(lengths - 1, 0)[:, None] if last else None
  logits, layers = apply_cached(model, params, fan, tokens, lengths, logits_at, from_empty=True)
  return (logits[:, 0] if last else logits), fan.split(layers, lengths)


@functools.partial(jax.jit, static_argnames=("model", "last"))
def _kvzip_prefill(model: Transformer, params, caches: tuple, tokens, lengths, last: bool):
  logits_at = jnp.maximum(lengths - 1, 0)[:, None] if last else None
  logits, full, scores = kvzip.reconstruct(model, params, caches[0].press, tokens, lengths, logits_at)
  return (logits[:, 0] if last else logits), [kvzip.fill(model.config, c, full, scores, lengths) for c in caches]


def prefill_many(
  model: Transformer,
  params,
  tokens,
  lengths,
  max_len: int,
  cache_configs: Sequence[CacheConfig],
  *,
  logits: str = "last",
) -> list[tuple[jax.Array, object]]:
  """Right-padded prompts tokens int[B, T], lengths int[B] into a cache of each of cache_configs
  (module docstring) -> [(logits, cache)], one per config in order, each what
  `prefill(model, params, tokens, lengths, max_len, logits=logits, cache_config=c)` returns.
  Configs sharing a prefill share its logits array. Errors are prefill's, naming the config."""
  if logits not in decode.LOGITS:
    raise ValueError(f"logits must be one of {decode.LOGITS}, got {logits!r}")
  configs = list(cache_configs)
  for i, c in enumerate(configs):
    if not isinstance(c, CacheConfig):
      raise ValueError(f"cache_configs[{i}] must be a CacheConfig, got {c!r}")
  if not configs:
    raise ValueError("cache_configs must hold at least one CacheConfig")
  check_positive_int(max_len, "max_len")
  tokens, lengths = decode.check_tokens(model, tokens, lengths)
  if tokens.shape[1] > max_len:
    raise ValueError(f"prompt of {tokens.shape[1]} tokens does not fit the cache length max_len={max_len}")
  out: list = [None] * len(configs)
  groups: list[list[tuple[int, object]]] = []  # caches that share one prefill: [(config index, cache)]
  replays: dict = {}  # KVzip.replayer -> [(config index, cache)]
  for i, c in enumerate(configs):
    if not _shares(c):
      out[i] = decode.prefill(model, params, tokens, lengths, max_len, logits=logits, cache_config=c)
      continue
    c.model(model.config).check_length(max_len, f"cache_configs[{i}]: cache length max_len={max_len}")
    cache = kinds.create(model.config, c, tokens.shape[0], max_len, prompt=tokens.shape[1], bucket=True)
    decode.check_cache(model, cache, lengths)
    if isinstance(c.press, KVzip) and c.press.compression_ratio > 0:
      c.press.check_prompt(model.config.vocab_size)
      replays.setdefault(c.press.replayer, []).append((i, cache))
      continue
    group = next((g for g in groups if shares_prefill(g[0][1], cache)), None)
    if group is None:
      groups.append([(i, cache)])
    else:
      group.append((i, cache))
  width = tokens.shape[1]
  room = max(model.config.max_positions, width)
  padded = np.zeros((tokens.shape[0], size_bucket(width, room)), np.int32)  # as `extend` pads a call
  padded[:, :width] = tokens
  fast = decode.for_decoding(model)
  last = logits == "last"
  for group in groups:
    got, caches = _fanout_prefill(fast, params, Fanout.of([c for _, c in group]), padded, lengths, last)
    got = _cut(got, width, last)
    for (i, _), cache in zip(group, caches):
      out[i] = (got, cache)
  for members in replays.values():
    got, caches = _kvzip_prefill(fast, params, tuple(c for _, c in members), padded, lengths, last)
    got = _cut(got, width, last)
    for (i, _), cache in zip(members, caches):
      out[i] = (got, cache)
  return out


def compilations() -> dict[str, int]:
  """The compiled functions this process holds for prefill_many and answer_many, by function:
  what bounds a study's compile time (each is compiled once per shape and static setting)."""
  return {
    "shared prefill": _fanout_prefill._cache_size(),
    "kvzip prefill": _kvzip_prefill._cache_size(),
    **stacking.compilations(),
    "prefill, extend and decode step": decode.compilations(),
  }


def _cut(logits, width: int, last: bool):
  """A padded call's logits cut back to its width, on the host as `extend` does."""
  if last or logits.shape[1] == width:
    return logits
  return jax.device_put(np.asarray(logits)[:, :width], logits.sharding)


def batch_size(n: int) -> int:
  """The batch a decode of n rows runs at: n rounded up to a power of two below 8, to a multiple
  of 8 from there (a bounded set of compiled shapes)."""
  return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def answer_many(
  model: Transformer,
  params,
  caches: Sequence,
  new_tokens: int | Sequence[int],
  *,
  first: Sequence | None = None,
  question: np.ndarray | None = None,
  question_lengths: np.ndarray | None = None,
  stop_ids: Sequence[int] = (),
  until: Callable[[list[int]], bool] | None = None,
) -> list[list[np.ndarray]]:
  """Greedy answers of every row of every prefilled cache in `caches` (contiguous or evicting,
  one codec; module docstring) -> for each cache, its rows' answers (int32, cut before the first
  stop id).

  new_tokens: each cache's budget (one int for all): a row stops after that many tokens.
  first: each cache's first answer tokens int[B] (its prefill's argmax: the query-aware protocol,
    the question inside the prompt), or None with `question`;
  question: int[B, q] right-padded to question_lengths int[B], read into every cache's rows (the
    query-agnostic protocol): row b of every cache reads question row b.
  """
  caches = list(caches)
  n = len(caches)
  budgets = [new_tokens] * n if isinstance(new_tokens, (int, np.integer)) else list(new_tokens)
  if len(budgets) != n:
    raise ValueError(f"new_tokens: {len(budgets)} budgets for {n} caches")
  for b in budgets:
    check_positive_int(b, "new_tokens")
  if (first is None) == (question is None):
    raise ValueError("answer_many takes the first tokens (query-aware) or a question (query-agnostic), one of them")
  rows = [int(c.lengths.shape[0]) for c in caches]
  answers: list[list[list[int]]] = [[[] for _ in range(r)] for r in rows]
  classes: list[list[int]] = []  # caches that decode in one batch: one reading, one read route
  for i, c in enumerate(caches):
    alike = (
      j for j in classes if stacking.uneven(caches[j[0]]) == stacking.uneven(c) and stacking.joins(caches[j[0]], c)
    )
    members = next(alike, None)
    if members is None:
      classes.append([i])
    else:
      members.append(i)
  extra = (0 if question is None else question.shape[1]) + max(budgets)
  for members in classes:
    slots = -(-(max(stacking.held(caches[i]) for i in members) + extra) // SLOTS) * SLOTS
    owner = [(i, r) for i in members for r in range(rows[i])]  # (cache, row) of each stacked row
    limit = np.array([budgets[i] for i, _ in owner])
    cache = stacking.stack(model.config, [caches[i] for i in members], slots)
    if question is not None:
      q = np.concatenate([question] * len(members))
      q_len = np.concatenate(
        [question_lengths if question_lengths is not None else np.full(len(question), q.shape[1])] * len(members)
      )
      cache, q, q_len = _padded_rows(cache, len(owner), q, q_len)
      logits, cache = decode.extend(model, params, cache, q, q_len, logits="last")
      token = np.asarray(jnp.argmax(logits, axis=-1), np.int32)[: len(owner)]
    else:
      token = np.concatenate([np.asarray(first[i], np.int32) for i in members])
      (cache,) = _padded_rows(cache, len(owner))
    _decode(model, params, cache, token, limit, owner, answers, stop_ids, until)
  return [[np.asarray(a, np.int32) for a in per] for per in answers]


def _padded_rows(cache, n: int, *row_arrays):
  """cache (and arrays whose rows match it) with rows repeated up to batch_size(n)."""
  index = np.concatenate([np.arange(n), np.zeros(batch_size(n) - n, np.int64)])
  return (stacking.take(cache, index), *(a[index] for a in row_arrays))


def _decode(model, params, cache, token, limit, owner, answers, stop_ids, until) -> None:
  """Greedy decode steps from `token` (int32 [n], each row's first answer token) until every row
  has its answer: limit int[n] tokens, a stop id or `until`; answers[cache][row] gets row i's
  tokens."""
  stops = set(int(s) for s in stop_ids)

  def ended(tokens: list[int], budget: int) -> bool:
    return tokens[-1] in stops or len(tokens) >= budget or (until is not None and until(tokens))

  live = np.arange(len(owner))  # the stacked rows the batch's first len(live) rows hold
  for i, t in zip(live, token):
    cache_index, row = owner[i]
    answers[cache_index][row].append(int(t))
  done = np.array([ended(answers[owner[i][0]][owner[i][1]], limit[i]) for i in live])
  while not done.all():
    if 2 * int((~done).sum()) <= cache.lengths.shape[0] and batch_size(int((~done).sum())) < cache.lengths.shape[0]:
      keep = np.flatnonzero(~done)
      live, token, limit, done = live[keep], token[keep], limit[keep], done[keep]
      index = np.concatenate([keep, np.full(batch_size(len(keep)) - len(keep), keep[0])])
      cache = stacking.take(cache, index)
    feed = np.zeros(cache.lengths.shape[0], np.int32)
    feed[: len(token)] = token
    logits, cache = decode.decode_step(model, params, cache, feed)
    token = np.asarray(jnp.argmax(logits, axis=-1), np.int32)[: len(live)]
    for k, (i, t) in enumerate(zip(live, token)):
      if not done[k]:
        cache_index, row = owner[i]
        answers[cache_index][row].append(int(t))
        done[k] = ended(answers[cache_index][row], limit[k])
  for per in answers:
    for a in per:
      if a and a[-1] in stops:
        a.pop()
