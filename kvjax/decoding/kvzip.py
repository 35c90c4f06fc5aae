"""The prefill of an evicting cache whose press is KVzip (kvjax.cache.kvzip): the prompt through
a full cache, the context's reconstruction scoring every layer's keys, then the evicting cache
filled with the tokens the scores keep. Traced: it runs inside the decode functions' jit
(kvjax.decoding.decode.forward routes a first call here)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.config import CacheConfig
from kvjax.cache.contiguous import ContiguousCache
from kvjax.cache.evict import EvictedCache
from kvjax.cache.kvzip import KVzip, ReplayCache, pressed_layer
from kvjax.model.transformer import Transformer, cache_collection, cache_layers


def applies(cache) -> bool:
  """Whether a first call into `cache` is KVzip's prefill."""
  return isinstance(cache, EvictedCache) and isinstance(cache.press, KVzip)


def check(model: Transformer, cache: EvictedCache) -> None:
  """ValueError unless KVzip can press a prompt of this model into `cache`: its repeat prompt in
  the model's tokens (the layers it may press: kvjax.cache.selection, when the cache was made)."""
  if cache.press.compression_ratio > 0:  # ratio 0 keeps every token without a reconstruction
    cache.press.check_prompt(model.config.vocab_size)


def prefill(model: Transformer, params, cache: EvictedCache, tokens: jax.Array, lengths: jax.Array, logits_at=None):
  """Right-padded prompts tokens int32[B, T], lengths int32[B] into an empty evicting cache whose
  press is KVzip -> (logits as Transformer returns them at logits_at, the pressed cache)."""
  check(model, cache)
  logits, full, scores = reconstruct(model, params, cache.press, tokens, lengths, logits_at)
  return logits, fill(model.config, cache, full, scores, lengths)


def reconstruct(model: Transformer, params, press: KVzip, tokens: jax.Array, lengths: jax.Array, logits_at=None):
  """Steps 1 and 2 of KVzip (kvjax.cache.kvzip): the prompt through a full cache, then its
  reconstruction -> (logits at logits_at, the full ContiguousCache, scores float32 [L, B, K, T]
  with the sinks raised and the padding -inf). They depend on the press's repeat prompt, chunks
  and sinks only (KVzip.replayer), so one reconstruction serves every ratio and head share."""
  config = model.config
  b, t = tokens.shape
  room = press.replay_room(t) if press.compression_ratio > 0 else 0  # ratio 0 keeps every token unscored
  full = ContiguousCache.create(config, b, t + room, CacheConfig())
  logits, variables = model.apply(
    {"params": params, "cache": full.layers},
    tokens,
    full.replace(layers={}),
    lengths=lengths,
    logits_at=logits_at,
    from_empty=True,
    mutable=["cache"],
  )
  full = full.replace(layers=variables["cache"], lengths=lengths)
  scores = jnp.zeros((config.num_layers, b, config.num_kv_heads, t), jnp.float32)
  if press.compression_ratio > 0:
    for start in press.chunks(t):
      replay, replay_lengths, end = press.replay(tokens, lengths, start)
      held = {f.name: getattr(full, f.name) for f in dataclasses.fields(ContiguousCache)}
      scorer = ReplayCache(**held, chunk_end=end, chunk_start=start, sinks=press.sinks)
      _, replayed = model.apply(
        {"params": params, "cache": full.layers},
        replay,
        scorer.replace(layers={}),
        lengths=replay_lengths,
        mutable=["cache"],
      )
      scores = scores + jnp.stack([layer["kvzip"][..., :t] for layer in cache_layers(replayed["cache"])])
  return logits, full, press.final_scores(scores, lengths)


def fill(config, cache: EvictedCache, full: ContiguousCache, scores: jax.Array, lengths: jax.Array) -> EvictedCache:
  """The empty KVzip cache `cache` (of a model of `config`) holding what its press keeps of the prompt in `full`, scored
  by `scores` (reconstruct's)."""
  t = scores.shape[-1]
  keep = cache.press.kept(scores, lengths, cache.usable().sum(dtype=jnp.int32))
  stored = cache_layers(full.layers)

  def layer(i):
    arrays = full.readable(stored[i])
    new = {"k": arrays["k"][..., :t].swapaxes(2, 3), "v": arrays["v"][:, :, :t]}  # [B, K, T, H]
    return pressed_layer(cache, new, scores[i], keep[i])

  return cache.replace(layers=cache_collection(config, layer), lengths=cache.lengths + lengths)
