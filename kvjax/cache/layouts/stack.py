"""Rows of many caches as one evicting cache, so that the answers of many caches decode together
in one batch (kvjax.decoding.many): a decode step of 40 rows reads the weights once where five
steps of 8 rows read them five times.

`stack` takes prefilled caches of one codec, rotation and window pattern (kvjax.cache.layouts.fanout:
shares_prefill): the full cache (contiguous), and evicting caches of any press, ratio and prompt
budget (no decode budget: a decode-time rule differs per press). Each row keeps exactly what it
held: an evicting row its slots, positions and scores, a contiguous row its positions 0..n-1 in
slots 0..n-1 (the full cache as an evicting cache that has dropped nothing); windowed layers keep
their rings, which every such cache lays out alike. The stacked cache has `slots` slots per row,
at least what any row holds plus the tokens still to come, so no row ever evicts: its press only
chooses how a read goes. `uneven` says whether some row's heads hold different numbers of
tokens (AdaKV, KVzip): then every read goes by positions (XLA); otherwise a decode step reads
slots [0, filled) of each row through the contiguous decode route (kvjax's CPU kernel), as the
evicting cache does.

Contiguous caches whose payload no evicting cache holds (MLA's latents: one vector shared by every
head, kvjax.cache.layouts.evict) are joined as one contiguous cache instead, row after row: they
are read as each of them would be.

`take` keeps some rows of a cache (a batch whose rows stopped, shrunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.base import KVCache
from kvjax.cache.layouts.contiguous import ContiguousCache, seq_axis
from kvjax.cache.layouts.evict import BOOKKEEPING, EvictedCache
from kvjax.cache.layouts.fanout import READ_ALIKE, shares_prefill
from kvjax.cache.presses import StreamingLLM
from kvjax.model.attention import kv_payload
from kvjax.model.transformer import cache_collection, cache_layers

# The stacked cache's press: it never evicts (its slots hold every row's future tokens); should a
# row fill, the oldest token would go first. heads="adaptive" makes every read go by positions.
EVEN = StreamingLLM(sinks=0)
UNEVEN = StreamingLLM(sinks=0, heads="adaptive")


def held(cache: KVCache) -> int:
  """The most tokens any row, layer and head of a cache (contiguous or evicting) holds."""
  if type(cache) is ContiguousCache:
    return int(np.asarray(cache.lengths).max())
  positions = jax.device_get([layer["positions"] for layer in _global_layers(cache)])  # one transfer
  return max(int((p >= 0).sum(axis=-1).max()) for p in positions)


def uneven(cache: KVCache) -> bool:
  """Whether a cache's heads may hold different numbers of tokens (its reads go by positions)."""
  return isinstance(cache, EvictedCache) and (cache.adaptive or bool(cache.press.decode_budget))


def joins(a: KVCache, b: KVCache) -> bool:
  """Whether caches a and b can be stacked: read alike (kvjax.cache.layouts.fanout) over as many positions."""
  return shares_prefill(a, b) and a.max_len == b.max_len


def _global_layers(cache: EvictedCache) -> list[dict]:
  return [layer for layer in cache_layers(cache.layers) if "positions" in layer]


def _fit(x: jax.Array, axis: int, size: int, fill) -> jax.Array:
  """x cut or padded with `fill` to `size` along `axis`."""
  x = jax.lax.slice_in_dim(x, 0, min(size, x.shape[axis]), axis=axis)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=fill)


def _as_slots(cache: KVCache, layer: dict, slots: int) -> dict:
  """A global layer of a contiguous or evicting cache as an evicting layer of `slots` slots."""
  if "positions" not in layer:  # the full cache: position p in slot p
    name = cache.payload[0][0]
    storage = layer[name].shape[seq_axis(cache.fields[name].transposed, layer[name].ndim)]
    heads = cache.payload[0][1].heads
    p = jnp.arange(storage, dtype=jnp.int32)
    positions = jnp.where(p[None, :] < cache.lengths[:, None], p[None, :], -1)  # [B, S]
    b = positions.shape[0]
    layer = layer | {
      "positions": jnp.broadcast_to(positions[:, None], (b, heads, storage)),
      "scores": jnp.zeros((b, heads, storage), jnp.float32),
    }
  out = {}
  for name, x in layer.items():
    if name in BOOKKEEPING:
      out[name] = _fit(x, x.ndim - 1, slots, -1 if name == "positions" else 0)
    else:
      out[name] = _fit(x, seq_axis(cache.fields[name.removesuffix("_scale")].transposed, x.ndim), slots, 0)
  return out


def evicting_rows(config, cache: KVCache) -> bool:
  """Whether a cache's rows can be held by an evicting cache: its payload is the model's K/V."""
  return dict(cache.payload) == kv_payload(config)


def stack(config, caches: list[KVCache], slots: int) -> KVCache:
  """One evicting cache of `slots` slots per row holding the rows of `caches` (of a model of
  `config`) in order (module docstring), or for contiguous caches of a payload no evicting cache
  holds, one contiguous cache of their rows; ValueError naming a cache that cannot join the first,
  or `slots` fewer than a row holds."""
  first = caches[0]
  for i, cache in enumerate(caches):
    if type(cache) not in (ContiguousCache, EvictedCache):
      raise ValueError(f"stack: cache {i} is a {type(cache).__name__}; it takes contiguous and evicting caches")
    if isinstance(cache, EvictedCache) and cache.press.decode_budget:
      raise ValueError(f"stack: cache {i}'s press {cache.press!r} presses while decoding; decode it on its own")
    if not joins(first, cache):
      raise ValueError(
        f"stack: cache {i} (codec {cache.codec.name}, window {cache.window}, {cache.max_len} positions) "
        f"differs from cache 0 ({first.codec.name}, {first.window}, {first.max_len})"
      )
  most = max(held(cache) for cache in caches)
  if slots < most:
    raise ValueError(f"stack: slots={slots} is fewer than the {most} tokens a row holds")
  limits = {None if c.limit is None else int(c.limit) for c in caches}
  if len(limits) > 1:
    raise ValueError(f"stack: the caches hold different numbers of positions per row ({sorted(map(str, limits))})")
  if not evicting_rows(config, first):
    if any(type(c) is not ContiguousCache for c in caches):
      raise ValueError("stack: caches of a payload no evicting cache holds must all be contiguous")
    return _joined(tuple(caches))
  press = UNEVEN if any(uneven(c) for c in caches) else EVEN
  return _stacked(config, tuple(caches), slots, press)


@jax.jit
def _joined(caches: tuple) -> ContiguousCache:
  """Contiguous caches of one shape but their rows as one: their rows one after another."""
  rows = [int(c.lengths.shape[0]) for c in caches]
  per_row = lambda *xs: jnp.concatenate(xs) if xs[0].ndim and xs[0].shape[0] == rows[0] else xs[0]
  return caches[0].replace(
    layers=jax.tree.map(per_row, *[c.layers for c in caches]), lengths=jnp.concatenate([c.lengths for c in caches])
  )


@functools.partial(jax.jit, static_argnames=("config", "slots", "press"))
def _stacked(config, caches: tuple, slots: int, press) -> EvictedCache:
  """stack's arrays in one compiled call (op by op, its thousands of small copies cost seconds)."""
  first = caches[0]
  per_cache = [cache_layers(cache.layers) for cache in caches]

  def layer(i):
    parts = []
    for cache, layers in zip(caches, per_cache):
      arrays = layers[i]
      parts.append(arrays if cache.layer_window(config, i).size else _as_slots(cache, arrays, slots))
    return {name: jnp.concatenate([p[name] for p in parts]) for name in parts[0]}

  return EvictedCache(
    layers=cache_collection(config, layer),
    lengths=jnp.concatenate([c.lengths for c in caches]),
    limit=first.limit,
    max_len=first.max_len,
    slots=slots,
    press=press,
    num_layers=config.num_layers,
    **{name: getattr(first, name) for name in READ_ALIKE},
  )


def take(cache: KVCache, rows: np.ndarray) -> KVCache:
  """The cache of rows `rows` (ints) of `cache`, in that order."""
  return _taken(cache, jnp.asarray(np.asarray(rows, np.int32)))


@jax.jit
def _taken(cache: KVCache, index: jax.Array) -> KVCache:
  b = cache.lengths.shape[0]
  return jax.tree.map(lambda x: x[index] if x.ndim and x.shape[0] == b else x, cache)


def compilations() -> dict[str, int]:
  """The compiled functions of stack and take this process holds."""
  return {"stack": _stacked._cache_size() + _joined._cache_size(), "take": _taken._cache_size()}
