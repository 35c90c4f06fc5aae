"""Caches holding random payloads, written by each cache itself: what a benchmark or a study times
a decode step over (the time of a step does not depend on what the cache holds), without a
prefill of the context first."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.cache import kinds
from kvjax.cache.base import KVCache
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.evict import EvictedCache
from kvjax.cache.selection import kept
from kvjax.config import ModelConfig
from kvjax.model.attention import Span
from kvjax.model.transformer import cache_collection, cache_layers


def filled(cache: KVCache, cfg: ModelConfig, context: int) -> KVCache:
  """`cache` (empty) with every row holding `context` random positions, without running a
  prefill: a random normal payload written by the cache itself, so in its codec (quantized, with
  scales, for an int8 / int4 / fp8 cache) and its layout (the rows' pages for a paged cache)."""
  batch, length = cache.lengths.shape[0], cache.capacity
  span = Span(
    positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
    lengths=jnp.full((batch,), length, jnp.int32),
  )
  keys = jax.random.split(jax.random.key(1), cfg.num_layers)
  stored = cache_layers(cache.layers)

  def payload(i):
    draws = jax.random.split(keys[i], len(cache.fields))
    return {
      name: jax.random.normal(key, (batch, field.heads, length, field.width))  # [B, heads, S, width]
      for key, (name, field) in zip(draws, cache.fields.items())
    }

  layers = cache_collection(
    cfg, lambda i: _write(cache, stored[i], payload(i), span.replace(window=cache.layer_window(cfg, i)))
  )
  return cache.replace(layers=layers, lengths=jnp.full((batch,), context, jnp.int32))


@functools.partial(jax.jit, donate_argnames=("stored",))
def _write(cache, stored, new, span):
  return cache.write(stored, new, span)


def filled_evicted(config, cache_config: CacheConfig, batch: int, context: int, max_len: int) -> EvictedCache:
  """An evicting cache whose rows hold int(context * (1 - ratio)) random tokens spread over
  positions [0, context), every slot of the kept prompt filled, as after a pressed prefill (a
  windowed layer's ring holds the last positions of `held`: what it holds is timed, not read)."""
  cache = kinds.create(config, cache_config, batch, max_len, prompt=context)
  held = int(kept(context, cache_config.press.compression_ratio))
  layers = filled(cache.replace(max_len=held), config, 0).layers  # slots [0, held) written in order
  positions = jnp.broadcast_to(jnp.linspace(0, context - 1, held).astype(jnp.int32), (batch, config.num_kv_heads, held))
  for layer in cache_layers(layers):
    if "positions" not in layer:  # a windowed layer's ring
      continue
    layer["positions"] = layer["positions"].at[..., :held].set(positions)
  return cache.replace(layers=layers, lengths=jnp.full((batch,), context, jnp.int32))
