"""Pressing an evicting cache back to a budget as it decodes (a press's decode_budget,
kvjax.cache.presses): kvpress's DecodingPress and chunked prefill over kvjax's slots.

A global layer of an evicting cache under a budget has decode_budget + headroom slots. Each call
writes its tokens to empty slots (kvjax.cache.evict), its queries read what the row held with
them, and then, when the row holds decode_budget + decode_interval tokens (every decode_interval generated
tokens) or its slots are full, or the
call brought several tokens (a prompt chunk, an extended turn), the row drops its lowest-scoring
held tokens down to decode_budget. So a query reads the budget and its own call's tokens, and a
row never holds more than the slots: the cache's memory is constant however long the generation.
Dropped tokens leave holes (position -1), which the next call's tokens fill; reads go by
positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.model.attention import NEG_INF, Visibility, group_queries


def slot_weights(q: jax.Array, k: jax.Array, keys: Visibility, valid: jax.Array) -> jax.Array:
  """Softmax attention weights of a call's queries over a layer's slots.

  Args:
    q: [B, T, N, H] every column's queries (rotated); k: [B, K, H, S] the slots' keys (decoded).
    keys: which slot each query reads (positions per kv head, key_positions [B, K, S]).
    valid: bool[B, T], the call's real columns (padding columns get zero weights).
  Returns:
    float32 [B, K, G, T, S].
  """
  h = q.shape[-1]
  queries = group_queries(q, k.shape[1]) * h**-0.5  # [B, T, K, G, H]
  scores = jnp.einsum("btkgh,bkhs->bkgts", queries, k.astype(q.dtype), preferred_element_type=jnp.float32)
  mask = keys.mask()  # [B, K, T, S]
  weights = jax.nn.softmax(jnp.where(mask[:, :, None], scores, NEG_INF), axis=-1)
  return jnp.where(valid[:, None, None, :, None] & mask[:, :, None], weights, 0.0)


def press_to_budget(positions: jax.Array, scores: jax.Array, full: jax.Array, budget: int, several: bool) -> jax.Array:
  """The positions int[B, K, S] a layer holds after a call (-1: empty): where a row holds `full`
  tokens (budget + decode_interval, or its slots) or the call brought `several`, each head keeps its
  `budget` best-scoring held tokens (scores float32 [B, K, S]), dropping the lowest first and, of
  equal scores, the earlier position."""
  held = positions >= 0
  count = held.sum(axis=-1)  # [B, K]
  press = count >= full if not several else count > budget
  excess = jnp.where(press, jnp.maximum(count - budget, 0), 0)
  by_position = jnp.argsort(jnp.where(held, positions, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
  ranked = jnp.take_along_axis(jnp.where(held, scores, jnp.inf), by_position, axis=-1)
  order = jnp.take_along_axis(by_position, jnp.argsort(ranked, axis=-1, stable=True), axis=-1)  # worst first
  rank = jnp.argsort(order, axis=-1)  # each slot's place in that order
  return jnp.where(rank < excess[..., None], -1, positions)
