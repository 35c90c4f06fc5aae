"""One prefill, many caches: a cache that hands every layer's prompt to several caches at once.

A press compresses what a layer stores after the layer has attended over the whole prompt
(kvjax.cache.layouts.evict: a prompt's first call reads its own keys and values, as a plain forward pass
does), so the hidden states of a prefill do not depend on the press, only on how the prompt's
K/V read back through the codec (KVCache.as_stored). A `Fanout` over caches of one codec,
rotation and window pattern therefore runs the model once: each layer attends over the prompt
once, and each child cache stores what it would have stored from its own prefill, a contiguous
child the prompt, an evicting child the tokens its press keeps. Presses that differ only in their
budgets (compression ratio, AdaKV's heads, PyramidKV's layers: Press.scoring) score the layer once
between them; each ratio and budget is a different cut of the same scores.

The children's arrays travel in one 'cache' collection, each name prefixed by the child's index
(`c3_k`); `split` returns the children. A Fanout serves a first call only (from an empty cache):
after it each child decodes on its own, or merged into one batch (kvjax.decoding.many).
"""

from __future__ import annotations

import flax.struct
import jax

from kvjax.cache.base import KVCache
from kvjax.cache.layouts.evict import EvictedCache
from kvjax.model.attention import Span, new_keys, row_positions
from kvjax.model.backend import Backend
from kvjax.cache.kvzip import KVzip
from kvjax.model.transformer import cache_layers


def prefix(child: int) -> str:
  """The prefix of child `child`'s array names in the collection."""
  return f"c{child}_"


# What decides how a prompt's K/V read back through a cache: its codec, payload, windows and sinks,
# MLA's absorbed form, its rotation.
READ_ALIKE = ("codec", "payload", "window", "sink_tokens", "window_override", "absorb", "rotation")


def shares_prefill(a: KVCache, b: KVCache) -> bool:
  """Whether a prompt's first call reads back alike through caches a and b (READ_ALIKE), so that
  one prefill serves both."""
  return all(getattr(a, name) == getattr(b, name) for name in READ_ALIKE)


class Fanout(flax.struct.PyTreeNode):
  """Empty caches `caches` (of one batch and one prefill reading: shares_prefill) filled by one
  first call. layers: the collection of every child's layers, names prefixed; lengths int32[B]."""

  layers: dict
  lengths: jax.Array
  caches: tuple = ()

  @classmethod
  def of(cls, caches: list[KVCache]) -> "Fanout":
    """A Fanout over empty caches of one batch size; ValueError naming the child that cannot
    share the first's prefill."""
    first = caches[0]
    for i, cache in enumerate(caches):
      if not shares_prefill(first, cache):
        raise ValueError(
          f"Fanout: cache {i} ({type(cache).__name__}, codec {cache.codec.name}, rotation {cache.rotation}, "
          f"window {cache.window}) reads a prompt back unlike cache 0 ({first.codec.name}, {first.rotation}, "
          f"{first.window}); give each its own prefill"
        )
      if isinstance(getattr(cache, "press", None), KVzip):
        raise ValueError(
          f"Fanout: cache {i}'s press is KVzip, which scores a prompt in a model-level pass of its own "
          "(kvjax.decoding.kvzip), not inside the prefill's layers"
        )
      if cache.lengths.shape != first.lengths.shape:
        raise ValueError(f"Fanout: cache {i} has {cache.lengths.shape[0]} rows, cache 0 {first.lengths.shape[0]}")
    per_layer = [cache_layers(cache.layers) for cache in caches]

    def layer(i):
      return {prefix(j) + name: x for j, layers in enumerate(per_layer) for name, x in layers[i].items()}

    stripped = tuple(cache.replace(layers={}) for cache in caches)
    return cls(layers=_collection(len(per_layer[0]), layer), lengths=first.lengths, caches=stripped)

  def split(self, layers: dict, lengths: jax.Array) -> list[KVCache]:
    """The children holding the arrays of collection `layers` (a first call's), each row holding
    lengths[b] more tokens."""
    per_layer = cache_layers(layers)
    out = []
    for j, cache in enumerate(self.caches):
      p = prefix(j)

      def layer(i, p=p):
        return {name[len(p) :]: x for name, x in per_layer[i].items() if name.startswith(p)}

      out.append(cache.replace(layers=_collection(len(per_layer), layer), lengths=cache.lengths + lengths))
    return out

  # What the model's layers call (kvjax.model.attention.cached_attention): the first child speaks
  # for all of them where they agree (shares_prefill).

  def call_positions(self, t: int) -> jax.Array:
    return row_positions(self.lengths, t)

  def layer_window(self, config, layer: int):
    return self.caches[0].layer_window(config, layer)

  def rotate_in(self, query, new: dict):
    return self.caches[0].rotate_in(query, new)

  def rotate_out(self, out: jax.Array) -> jax.Array:
    return self.caches[0].rotate_out(out)

  def attend(self, stored: dict, query, q_positions, new: dict, span: Span, backend: Backend):
    """A first call: the prompt attends over itself once; each child stores its share of it."""
    if not span.from_empty:
      raise ValueError("a Fanout fills empty caches with a prompt; decode each cache it returns")
    out = query.attend(self.caches[0].as_stored(new), new_keys(q_positions, span), backend=backend)
    scored = {}  # Press.scoring -> the layer's prompt scores [B, K, T]
    arrays = {}
    for j, cache in enumerate(self.caches):
      p = prefix(j)
      if type(cache) is EvictedCache and not span.window.size:
        scorer = cache.press.scoring
        if scorer not in scored:
          scored[scorer] = cache.press.prompt_scores(
            query.every_q, new["k"], new["v"], span.lengths, query.rope, query.out
          )
        held = cache.compress(new, query.every_q, span, query.rope, scores=scored[scorer])
      else:  # its own first call; the output it computes is the one above, unused (XLA drops it)
        mine = {name[len(p) :]: x for name, x in stored.items() if name.startswith(p)}
        held, _ = cache.attend(mine, query, q_positions, new, span, backend)
      arrays |= {p + name: x for name, x in held.items()}
    return arrays, out


def _collection(num_layers: int, layer) -> dict:
  """A 'cache' collection of num_layers layers whose layer i is layer(i) (kvjax.model.transformer's
  cache_collection, where no ModelConfig is at hand)."""
  return {f"layers_{i}": {"attn": layer(i)} for i in range(num_layers)}
