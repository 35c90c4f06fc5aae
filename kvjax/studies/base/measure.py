"""The measurement layer every study uses, toy or pretrained: what a model decoded through a KV
cache of a CacheConfig costs and how well it still reads its context.

  kv_bytes_per_token  the cache's physical bytes for the prompt it holds: a one-row cache of
                      `context` positions whose prompt is `context` tokens (kinds.cache_bytes:
                      codec scales, rings, an evicting cache's kept slots and their bookkeeping,
                      the row's length), over `context`. An evicting cache holds the slots its
                      press keeps of that prompt, so its bytes fall with the compression ratio.
  nll                 negative log-likelihood through a cache: each window's first `context`
                      tokens prefilled through it (a press compresses them, a window drops what
                      leaves it), the rest read after them by one extend or one decode step per
                      token, and scored (the prefill's own predictions too, when asked).
  perplexity          exp of nll per scored token.
  answers / recall    greedy answers through a cache (kvjax.generate; the engine for a paged
                      cache; or, query-agnostic, the context prefilled first and the question read
                      into what the press kept), judged per sample: one record per example kept.
  decode_step_ms      one decode step of `batch` rows holding `context` positions.
The timed request (one jitted `generate` of a batch, models round-robin) is
kvjax.studies.base.stages.time_per_sample.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.fill import filled, filled_evicted
from kvjax.decoding import decode
from kvjax.decoding.step_timer import decode_step_seconds
from kvjax.model.transformer import Transformer
from kvjax.serving.engine import Engine, EngineConfig

# (inputs, targets) int32 [n, L]: windows of L tokens and the token after each position.
Window = tuple[np.ndarray, np.ndarray]

# How a long-context prompt meets its cache: the context alone, then the question read into the
# pressed cache (kvpress's protocol), or the whole prompt at once (the question is pressed too).
PROTOCOLS = ("query_agnostic", "query_aware")


def padded(rows) -> tuple[np.ndarray, np.ndarray]:
  """Token lists (or int arrays) -> (int32 [n, longest] right-padded with 0, lengths int32 [n])."""
  lengths = np.array([len(r) for r in rows], np.int32)
  out = np.zeros((len(rows), lengths.max()), np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out, lengths


def protocol_inputs(protocol: str, contexts, questions) -> tuple[np.ndarray, np.ndarray, dict]:
  """The one split of the two protocols, for samples of context ids and question ids (lists of
  token lists or int arrays, one per sample) -> (prompts int32 [n, P] right-padded, lengths int32
  [n], the keywords of `answers` and `recall`):
    query_agnostic  kvpress's: the contexts are the prompts (a press compresses them before the
                    question is known), the questions read after them ({question, question_lengths});
    query_aware     each context and its question, one prompt (a press sees the question; {})."""
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
  if protocol == "query_aware":
    prompts, lengths = padded([list(c) + list(q) for c, q in zip(contexts, questions)])
    return prompts, lengths, {}
  prompts, lengths = padded(contexts)
  question, question_lengths = padded(questions)
  return prompts, lengths, {"question": question, "question_lengths": question_lengths}


def kv_bytes_per_token(config, cache_config: CacheConfig, context: int) -> float:
  """Bytes of a one-row cache of `context` positions holding a `context`-token prompt, over `context`."""
  return kinds.cache_bytes(config, cache_config, 1, context, prompt=context) / context


@functools.partial(jax.jit, static_argnames="model")
def _decoded_nats(model: Transformer, params, cache, inputs, targets):
  """inputs, targets int32 [B, T] fed one column per decode step after what `cache` holds ->
  summed cross entropy of the steps' logits."""
  ones = jnp.ones((inputs.shape[0],), jnp.int32)

  def step(cache, column):
    token, target = column  # [B], [B]
    logits, cache = decode.forward(model, params, cache, token[:, None], ones, last=True)  # [B, V]
    return cache, optax.softmax_cross_entropy_with_integer_labels(logits, target).sum()

  _, nats = jax.lax.scan(step, cache, (inputs.T, targets.T))
  return nats.sum()


@jax.jit
def _nats(logits, targets):
  """logits float32 [B, T, V], targets int32 [B, T] -> summed cross entropy."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()


def nll(
  model: Transformer,
  params,
  windows: Sequence[Window],
  cache_config: CacheConfig,
  context: int,
  *,
  score_context: bool = False,
  stepwise: bool = False,
) -> tuple[float, int]:
  """(summed negative log-likelihood in nats, tokens scored) of `windows` read through a cache of
  cache_config.

  Each window's first `context` tokens are prefilled into a cache of the window's length; the
  tokens after them are read into it by one extend, or (stepwise) one decode step each, so that
  every one of them attends to what the cache stored; their predictions are scored, and the
  prefill's own predictions too when score_context."""
  total, count = 0.0, 0
  for inputs, targets in windows:
    n, length = inputs.shape
    if not 0 < context <= length:
      raise ValueError(f"nll: context={context} must be in [1, {length}], the windows' length")
    logits, cache = decode.prefill(
      model,
      params,
      inputs[:, :context],
      np.full(n, context, np.int32),
      length,
      logits="all" if score_context else "last",
      cache_config=cache_config,
    )
    if score_context:
      total += float(_nats(logits, targets[:, :context]))
      count += n * context
    if context == length:
      continue
    rest, scored = inputs[:, context:], targets[:, context:]
    if stepwise:
      decode.check_cache(model, cache, np.full(n, length - context, np.int32))
      total += float(_decoded_nats(decode.for_decoding(model), params, cache, rest, scored))
    else:
      logits, _ = decode.extend(model, params, cache, rest, np.full(n, length - context, np.int32))
      picked = np.take_along_axis(
        np.asarray(-jax.nn.log_softmax(logits, axis=-1)), scored[:, :, None].astype(np.int64), axis=-1
      )
      total += float(picked.sum())
    count += scored.size
  return total, count


def perplexity(model: Transformer, params, windows: Sequence[Window], cache_config: CacheConfig, context: int) -> float:
  """exp(nll per token) of the tokens after each window's first `context`, read through the cache."""
  total, count = nll(model, params, windows, cache_config, context)
  return math.exp(total / count)


def answers(
  model: Transformer,
  params,
  prompts: np.ndarray,
  lengths: np.ndarray,
  new_tokens: int,
  cache_config: CacheConfig = CacheConfig(),
  *,
  stop_ids: Sequence[int] = (),
  question: np.ndarray | None = None,
  question_lengths: np.ndarray | None = None,
) -> list[np.ndarray]:
  """Greedy answers of at most new_tokens (int32, cut before the first stop id), one per prompt
  (prompts int32 [n, P] right-padded, lengths int32 [n]), decoded through a cache of cache_config.

  With `question` (int32 [q], or [n, q]: one per prompt, right-padded to question_lengths int32
  [n] when given): the query-agnostic protocol. Each prompt is prefilled through the cache first (a press compresses it before the question is known), then the question is read into
  what it kept, and the answer decoded. Without: the whole prompt in one generate (a press sees the
  question: the query-aware protocol), or through the engine's pages for a paged cache."""
  if question is not None:
    return _answers_after(
      model, params, prompts, lengths, new_tokens, cache_config, stop_ids, question, question_lengths
    )
  if cache_config.layout != "paged":
    out = decode.generate(model, params, prompts, lengths, new_tokens, stop_ids=stop_ids, cache_config=cache_config)
    return decode.until_stop(np.asarray(out), stop_ids)
  page_size = cache_config.page_size
  pages = -(-(int(lengths.max()) + new_tokens) // page_size)
  engine = Engine(
    model,
    params,
    EngineConfig(
      num_slots=len(prompts),
      num_pages=len(prompts) * pages + 1,
      cache=cache_config,
      max_len=pages * page_size,
      stop_ids=tuple(stop_ids),
    ),
  )
  ids = [engine.submit(prompt[:length], new_tokens) for prompt, length in zip(prompts, lengths)]
  out = engine.run()
  return [out[i][:-1] if len(out[i]) and out[i][-1] in stop_ids else out[i] for i in ids]


def _answers_after(
  model, params, prompts, lengths, new_tokens, cache_config, stop_ids, question, question_lengths
) -> list[np.ndarray]:
  n, q = len(prompts), question.shape[-1]
  max_len = int(lengths.max()) + q + new_tokens
  _, cache = decode.prefill(model, params, prompts, lengths, max_len, logits="last", cache_config=cache_config)
  tokens = np.broadcast_to(question, (n, q))
  read = np.full(n, q) if question_lengths is None else np.asarray(question_lengths)
  logits, cache = decode.extend(model, params, cache, tokens, read, logits="last")
  out = [np.asarray(jnp.argmax(logits, axis=-1), np.int32)]
  while len(out) < new_tokens and not np.isin(np.stack(out, 1), stop_ids).any(axis=1).all():
    logits, cache = decode.decode_step(model, params, cache, out[-1])
    out.append(np.asarray(jnp.argmax(logits, axis=-1), np.int32))
  return decode.until_stop(np.stack(out, 1), stop_ids)


def recall(
  model: Transformer,
  params,
  prompts: np.ndarray,
  lengths: np.ndarray,
  expected: Sequence,
  judge: Callable[[np.ndarray, object], dict],
  new_tokens: int,
  cache_config: CacheConfig = CacheConfig(),
  *,
  batch_size: int | None = None,
  stop_ids: Sequence[int] = (),
  question: np.ndarray | None = None,
  question_lengths: np.ndarray | None = None,
) -> tuple[float, list[dict]]:
  """Recall of examples through a cache -> (the fraction of samples judged a hit, one record per
  sample).

  prompts int32 [n, P] and lengths int32 [n] are answered `batch_size` at a time (all at once by
  default) by `answers`, each in up to new_tokens greedy tokens (a judge may read fewer: the
  pass-key test cuts each answer to its sample's budget); judge(answer ids, expected[i]) -> a
  record with at least "hit" (bool), kept per sample with "index" so that two caches can be
  compared sample by sample."""
  step = batch_size or len(prompts)
  records = []
  for start in range(0, len(prompts), step):
    got = answers(
      model,
      params,
      prompts[start : start + step],
      lengths[start : start + step],
      new_tokens,
      cache_config,
      stop_ids=stop_ids,
      question=question if question is None or question.ndim == 1 else question[start : start + step],
      question_lengths=None if question_lengths is None else question_lengths[start : start + step],
    )
    for i, answer in enumerate(got, start):
      records.append({"index": i, **judge(np.asarray(answer), expected[i])})
  return float(np.mean([r["hit"] for r in records])), records


def decode_step_ms(
  model: Transformer, params, cache_config: CacheConfig, batch: int, context: int, repeats: int
) -> list[float]:
  """Milliseconds of `repeats` decode steps (after two warm-up ones) of `batch` rows holding
  `context` positions in a cache of cache_config (an evicting cache holds what its press keeps of
  a `context`-token prompt)."""
  max_len = context + repeats + 3
  if cache_config.press is not None:
    cache = filled_evicted(model.config, cache_config, batch, context, max_len)
  else:
    cache = filled(kinds.create(model.config, cache_config, batch, max_len), model.config, context)
  return [1e3 * s for s in decode_step_seconds(model, params, cache, repeats)]
