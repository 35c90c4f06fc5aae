"""The contiguous layout: every row preallocates its positions per layer.

Per layer and payload field (kvjax.cache.base), values [B, heads, S, W'] in the codec's dtype,
head major, so each (row, head) pair reads one contiguous block per decode step; a field read
as the scores' right operand (keys, Field.transposed) is stored [B, heads, W', S], so that the
decode scores are a plain [G, H] x [H, S] product with S contiguous (the sequence-major layout
[B, S, K, H] makes XLA's CPU dot transpose the whole cache every step). A quantized codec's
scales sit beside them with the same sequence axis: [B, heads, S] (one per vector), or
[B, heads, S, G] ([B, heads, G, S] transposed) for grouped scales. New vectors are scattered
into place (`scatter_rows`; bfloat16 and fp8 are stored as their bits, kvjax.cache.codec), in place since the
cache is donated.

A global layer keeps S = max_len positions. A sliding-window layer (the cache's window) keeps a
ring of S = window + sinks slots (max_len when that is fewer): the sinks in the first slots, then
position p >= sinks in slot sinks + (p - sinks) % window (`ring_slot`), so its memory does not
grow with the sequence. Reads mask by the position each slot holds (`ring_positions`). A model
whose every layer is windowed holds more positions per row than any buffer, past
ModelConfig.max_len with RoPE (ModelConfig.max_positions).

A one-token read of a K/V payload goes to the backend's decode route ("contiguous", codec):
kvjax's CPU kernel for every codec on one CPU device, XLA's `attend_one` otherwise.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache.base import KVCache, encode, layer_arrays, scale_shape, scatter_rows, size_bucket
from kvjax.cache.codec import Codec
from kvjax.cache.config import CacheConfig, register
from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.model.attention import Span, new_keys
from kvjax.model.keys import Visibility, Window, attend
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_payload

SEQ_AXIS = 2  # of the values and scales of a field that is not transposed


def layer_spec(config: ModelConfig, codec: Codec, batch: int, slots: int) -> dict:
  """{name: (shape, dtype)} of one layer of `batch` rows x `slots` positions (module docstring)."""
  spec = {}
  for name, field in cache_payload(config).items():
    width = codec.stored_width(field.width)
    shape = (batch, field.heads, width, slots) if field.transposed else (batch, field.heads, slots, width)
    spec[name] = (shape, codec.stored_dtype)
    scales = scale_shape(shape, codec, field, 2 if field.transposed else 3)
    if scales is not None:
      spec[name + "_scale"] = (scales, jnp.dtype(jnp.float32))
  return spec


def seq_axis(transposed: bool, ndim: int) -> int:
  """The sequence axis of a stored array: the last for a transposed field's values and scales."""
  return ndim - 1 if transposed else SEQ_AXIS


def attend_one(q, k_cache, v_cache, lengths, k_scale=None, v_scale=None, *, codec: Codec):
  """XLA's one-token attention over a K/V layer: q [B, 1, N, H] reads positions [0, lengths[b]]
  of k_cache [B, K, H', S] and v_cache [B, K, S, H'], decoded by `codec` with their scales."""
  k_cache, v_cache = codec.decode(k_cache, k_scale, axis=2), codec.decode(v_cache, v_scale, axis=-1)
  mask = (jnp.arange(v_cache.shape[SEQ_AXIS])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
  return attend(q, k_cache, v_cache, mask, k_transposed=True)


# Ring addressing of a windowed layer's buffer of `slots` slots (a global layer's slot is its position).


def ring_slot(positions: jax.Array, window: Window) -> jax.Array:
  """The slot of each position: p for the sinks, then sinks + (p - sinks) % window.size."""
  sinks = window.sinks
  return jnp.where(positions < sinks, positions, sinks + (positions - sinks) % window.size)


def ring_positions(held: jax.Array, slots: int, window: Window) -> jax.Array:
  """int[B, slots]: the position slot j holds once row b has written positions [0, held[b]),
  -1 where it holds none (slots past window + sinks, which a resized buffer may have, stay empty)."""
  j = jnp.arange(slots)[None, :]
  last = held[:, None] - 1
  latest = last - (last - j) % window.size  # the latest position <= last that maps to ring slot j
  position = jnp.where(j < window.sinks, j, latest)
  return jnp.where((j <= last) & (j < window.sinks + window.size), position, -1)


def write_slots(span: Span, slots: int) -> jax.Array:
  """int[B, T]: the slot each column of the call is written to; `slots` (dropped) for padding and,
  in a ring, for the positions the same call overwrites: it keeps its last window.size positions
  and the sinks, so the slots kept are distinct."""
  window = span.window
  if not window.size:
    return jnp.where(span.valid, span.positions, slots)
  end = span.positions[:, :1] + span.lengths[:, None]  # [B, 1]
  kept = span.valid & ((span.positions >= end - window.size) | (span.positions < window.sinks))
  return jnp.where(kept, ring_slot(span.positions, window), slots)


def filled_through(positions: jax.Array, slots: int, window: Window) -> jax.Array:
  """int[B]: the last slot written once row b holds positions [0, positions[b]]. Every slot up to
  it is one a query at positions[b] reads: a ring keeps only that query's window and sinks."""
  if not window.size:
    return positions
  return jnp.minimum(positions, min(slots, window.sinks + window.size) - 1)


def slot_positions(held: jax.Array, slots: int, window: Window) -> jax.Array:
  """int[B or 1, slots]: the position each slot holds once row b holds [0, held[b]) (-1: none)."""
  if not window.size:
    return jnp.arange(slots)[None, :]
  return ring_positions(held, slots, window)


@register("contiguous")
class ContiguousCache(KVCache):
  """Preallocated per-row buffers; see the module docstring for the layout.

  max_len (static): positions one row can hold.
  """

  max_len: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def create(
    cls, config: ModelConfig, batch: int, max_len: int, cache_config: CacheConfig = CacheConfig()
  ) -> "ContiguousCache":
    """An empty cache of `batch` rows with room for max_len positions each (at most
    ModelConfig.max_len, or ModelConfig.max_positions for a RoPE model whose every layer is
    windowed); a windowed layer keeps min(max_len, window + sinks) slots."""
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    statics = cls.statics(config, cache_config)
    model = cache_config.model(config)
    model.check_length(max_len, f"a cache of max_len={max_len} positions")
    memory.check_fits(
      f"a contiguous cache of {batch} rows x {max_len} positions", cls.bytes_for(config, cache_config, batch, max_len)
    )

    def layer(i):
      return layer_arrays(layer_spec(config, statics["codec"], batch, model.cached_positions(i, max_len)))

    return cls(
      layers=cache_collection(config, layer), lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len, **statics
    )

  @classmethod
  def rows(
    cls,
    config: ModelConfig,
    batch: int,
    max_len: int,
    cache_config: CacheConfig,
    prompt: int | None = None,
    bucket: bool = False,
  ) -> "ContiguousCache":
    """create(config, batch, max_len, cache_config): the signature every layout's `rows` shares.
    With `bucket`, the storage has size_bucket(max_len) positions and `limit` is max_len."""
    if not bucket:
      return cls.create(config, batch, max_len, cache_config)
    check_positive_int(max_len, "max_len")
    model = cache_config.model(config)
    model.check_length(max_len, f"a cache of max_len={max_len} positions")
    storage = cls.create(config, batch, size_bucket(max_len, model.max_positions), cache_config)
    return storage.replace(limit=jnp.asarray(max_len, jnp.int32))

  @classmethod
  def sequence_bytes(cls, config: ModelConfig, cache_config: CacheConfig, length: int) -> int:
    """Bytes one row of `length` positions takes: each windowed layer keeps at most window + sinks."""
    model = cache_config.model(config)
    positions = sum(model.cached_positions(i, length) for i in range(config.num_layers))
    return positions * cls.position_bytes(config, cache_config)

  @classmethod
  def bytes_for(
    cls, config: ModelConfig, cache_config: CacheConfig, batch: int, max_len: int, prompt: int | None = None
  ) -> int:
    """Bytes of create(config, batch, max_len, cache_config): every row's layers and the lengths."""
    return batch * cls.sequence_bytes(config, cache_config, max_len) + 4 * batch

  @property
  def storage_positions(self) -> int:
    return self.max_len

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.codec, self.lengths.shape[0], config.cached_positions(layer, self.max_len))

  def partition_rule(self, name: str) -> tuple:
    return ("data", "model") if name == "layers" else ("data",)

  def slots(self, stored: dict) -> int:
    name, field = self.payload[0]
    return stored[name].shape[seq_axis(field.transposed, stored[name].ndim)]

  def write(self, stored, new, span: Span):
    slots = write_slots(span, self.slots(stored))
    out = {}
    for name, x in encode(self.codec, new).items():  # [B, heads, T, ...]
      transposed = self.fields[name.removesuffix("_scale")].transposed
      if transposed and x.ndim == 4:
        x = x.swapaxes(2, 3)
      out[name] = scatter_rows(stored[name], x, slots, seq_axis(transposed, x.ndim))
    return out

  def readable(self, stored: dict) -> dict:
    """{field: decoded arrays} as stored: transposed fields [B, heads, W, S], others [B, heads, S, W]."""
    return self.decoded(stored, {name: 2 if f.transposed else -1 for name, f in self.fields.items()})

  def read(self, stored, query, q_positions, span: Span, backend: Backend):
    """As KVCache.read; a one-token query is at its row's last position (every decode step, and
    the last layer of a call asking for each row's last logits)."""
    slots = self.slots(stored)
    if q_positions.shape[1] == 1 and query.kernel_query is not None:
      lengths = filled_through(q_positions[:, 0], slots, span.window)
      return backend.cache_attention(
        self.route,
        query.kernel_query,
        stored["k"],
        stored["v"],
        lengths,
        functools.partial(attend_one, codec=self.codec),
        **self.scales(stored),
      )
    held = span.positions[:, 0] + span.lengths
    keys = Visibility(q_positions, slot_positions(held, slots, span.window), span.window)
    return query.attend(self.readable(stored), keys, transposed=True, absorb=self.absorb, backend=backend)

  def attend(self, stored, query, q_positions, new, span: Span, backend: Backend):
    if not span.window.size or span.from_empty or q_positions.shape[1] == 1:
      return super().attend(stored, query, q_positions, new, span, backend)
    # A windowed layer's chunk may overwrite ring slots that its own earlier queries read, so the
    # queries read the ring as it was before the chunk, and the chunk's payload (as the ring will
    # hold it) beside it.
    slots = self.slots(stored)
    before = ring_positions(span.positions[:, 0], slots, span.window)
    key_positions = jnp.concatenate([before, new_keys(q_positions, span).key_positions], axis=1)  # [B, S + T]
    old, fresh = self.readable(stored), self.as_stored(new)
    arrays = {}
    for name, field in self.fields.items():
      x = fresh[name].astype(old[name].dtype)  # [B, heads, T, W]
      x = x.swapaxes(2, 3) if field.transposed else x
      arrays[name] = jnp.concatenate([old[name], x], axis=seq_axis(field.transposed, 4))
    keys = Visibility(q_positions, key_positions, span.window)
    out = query.attend(arrays, keys, transposed=True, absorb=self.absorb, backend=backend)
    return self.write(stored, new, span), out

  def resized(self, capacity: int) -> "ContiguousCache":
    """The same contents in buffers of exactly `capacity` positions (at least what every row
    holds; the storage of a bucket may shrink to it), without a limit; a copy, as the
    literature's growing caches make (kvjax.decoding.baselines). Every layer must keep all its
    positions: a windowed layer's ring does not grow."""
    if any(self.window):
      raise ValueError(
        f"resized takes a cache whose every layer keeps its {self.max_len} positions; "
        f"this one has windowed layers (window={self.window})"
      )

    def fit(path, x):
      axis = seq_axis(self.fields[path[-1].key.removesuffix("_scale")].transposed, x.ndim)
      widths = [(0, 0)] * x.ndim
      x = jax.lax.slice_in_dim(x, 0, min(capacity, x.shape[axis]), axis=axis)
      widths[axis] = (0, capacity - x.shape[axis])
      return jnp.pad(x, widths)

    layers = jax.tree_util.tree_map_with_path(fit, self.layers)
    return self.replace(layers=layers, max_len=capacity, limit=None)
