"""Caching strategies from the literature, kept for side-by-side study with the preallocated cache.

All three decode greedily and must produce the same tokens as `kvjax.generate`:
  generate_nocache:  no cache; every step recomputes the whole prefix with the full forward.
  generate_concat:   GPT-2's `layer_past`: every step concatenates the new K/V onto the past,
                     so the cache grows by one position and is copied each step. Shapes change
                     every step: one compilation per cache length (cached for later runs).
  generate_doubling: a preallocated buffer that doubles its capacity when full (amortised
                     O(1) growth, like a dynamic array); one compilation per capacity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decoding.decode import check_tokens, decode_step, for_decoding, forward, prefill
from kvjax.model.transformer import Transformer

NOCACHE_BUCKET = 64  # recompute over prefixes padded to a multiple of this, to bound compilations


def _start(model: Transformer, prompts, lengths, max_new_tokens: int):
  cfg = model.config
  prompts, lengths = check_tokens(model, prompts, lengths)
  longest = int(np.max(lengths))
  if longest + max_new_tokens - 1 > cfg.max_len:
    raise ValueError(
      f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds ModelConfig.max_len={cfg.max_len}"
    )
  return prompts, lengths


@functools.partial(jax.jit, static_argnames=("model",))
def _next_tokens_full(model, params, tokens, lengths):
  logits = model.apply({"params": params}, tokens)
  return jnp.argmax(logits[jnp.arange(tokens.shape[0]), lengths - 1], axis=-1).astype(jnp.int32)


def generate_nocache(model: Transformer, params, prompts, lengths, max_new_tokens: int) -> np.ndarray:
  """Greedy decoding that reruns the full causal forward over each row's prefix every step."""
  prompts, lengths = _start(model, prompts, lengths, max_new_tokens)
  batch, longest = prompts.shape[0], int(lengths.max())
  tokens = np.zeros((batch, longest + max_new_tokens), np.int32)
  tokens[:, : prompts.shape[1]] = prompts
  out = np.zeros((batch, max_new_tokens), np.int32)
  rows = np.arange(batch)
  for step in range(max_new_tokens):
    cur = lengths + step
    width = min(-(-int(cur.max()) // NOCACHE_BUCKET) * NOCACHE_BUCKET, tokens.shape[1])
    out[:, step] = np.asarray(_next_tokens_full(model, params, jnp.asarray(tokens[:, :width]), jnp.asarray(cur)))
    if step + 1 < max_new_tokens:
      tokens[rows, cur] = out[:, step]
  return out


def _decode_loop(cache, first, max_new_tokens, step_fn):
  out = [np.asarray(first)]
  token = first
  for _ in range(max_new_tokens - 1):
    logits, cache = step_fn(cache, token)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out.append(np.asarray(token))
  return np.stack(out, axis=1)


def _prefill_first(model, params, prompts, lengths, capacity):
  logits, cache = prefill(model, params, prompts, lengths, capacity, logits="last")
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("model",))
def _concat_step(model, params, cache, token):
  # layer_past + concatenate: the new buffers are one position longer, a full copy each step.
  logits, cache = forward(model, params, cache.resized(cache.capacity + 1), token[:, None], jnp.ones_like(token))
  return logits[:, 0], cache


def generate_concat(model: Transformer, params, prompts, lengths, max_new_tokens: int) -> np.ndarray:
  """Greedy decoding with a GPT-2-style cache that is concatenated with each new position."""
  prompts, lengths = _start(model, prompts, lengths, max_new_tokens)
  first, cache = _prefill_first(model, params, prompts, lengths, prompts.shape[1])
  cache = cache.resized(cache.capacity)  # prefill's storage is a bucket's; this cache grows from the prompt
  step = functools.partial(_concat_step, for_decoding(model), params)
  return _decode_loop(cache, first, max_new_tokens, step)


def generate_doubling(
  model: Transformer, params, prompts, lengths, max_new_tokens: int, initial_capacity: int = 16
) -> np.ndarray:
  """Greedy decoding with a preallocated buffer that doubles its capacity whenever it is full."""
  prompts, lengths = _start(model, prompts, lengths, max_new_tokens)
  capacity = max(initial_capacity, 1 << (prompts.shape[1] - 1).bit_length())
  first, cache = _prefill_first(model, params, prompts, lengths, capacity)
  written = int(lengths.max())  # host-side count, so growing needs no device sync

  def step(cache, token):
    nonlocal written
    if written == cache.capacity:
      cache = cache.resized(2 * cache.capacity)
    written += 1
    return decode_step(model, params, cache, token)

  return _decode_loop(cache, first, max_new_tokens, step)
