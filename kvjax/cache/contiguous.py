"""The contiguous cache: every row preallocates its positions per layer.

Per layer k [B, K, H, S] and v [B, K, S, H] in config.cache_dtype, kv-head major, so each
(row, kv head) pair reads one contiguous block per decode step; keys are stored transposed so
that the decode scores are a plain [G, H] x [H, S] product with S contiguous (the
sequence-major layout [B, S, K, H] makes XLA's CPU dot transpose the whole cache every step).
New K/V are scattered into place (`scatter_rows`), in place since the cache is donated.

A global layer keeps S = max_len positions. A sliding-window layer (ModelConfig.window) keeps a
ring of S = window + sinks slots (max_len when that is fewer): the sinks in the first slots, then
position p >= sinks in slot sinks + (p - sinks) % window (`ring_slot`), so its memory does not
grow with the sequence. Reads mask by the position each slot holds (`ring_positions`). A model
whose every layer is windowed holds more positions per row than any buffer, past
ModelConfig.max_len with RoPE (ModelConfig.max_positions).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache.base import KVCache, scatter_rows
from kvjax.config import ModelConfig, check_positive_int
from kvjax.model.attention import Span, Window, attend, new_keys_mask, visible
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_layers

# The sequence axis of each buffer: k [B, K, H, S], v [B, K, S, H].
SEQ_AXIS = {"k": 3, "v": 2}


def attend_one(q, k_cache, v_cache, lengths):
  """XLA's one-token attention over the buffers: q [B, 1, N, H] reads positions [0, lengths[b]]."""
  mask = (jnp.arange(v_cache.shape[SEQ_AXIS["v"]])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
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


class ContiguousCache(KVCache):
  """Preallocated per-row buffers; see the module docstring for the layout.

  max_len (static): positions one row can hold; None for the longest buffer's length.
  """

  max_len: int | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_len: int) -> "ContiguousCache":
    """An empty cache of `batch` rows with room for max_len positions each (at most
    ModelConfig.max_len, or ModelConfig.max_positions for a RoPE model whose every layer is
    windowed); a windowed layer keeps min(max_len, window + sinks) slots."""
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    config.check_length(max_len, f"a cache of max_len={max_len} positions")
    memory.check_fits(f"a contiguous cache of {batch} rows x {max_len} positions",
                      memory.contiguous_cache_bytes(config, batch, max_len))
    kv, h = config.num_kv_heads, config.head_dim

    def layer(i):
      slots = config.cached_positions(i, max_len)
      return {"k": jnp.zeros((batch, kv, h, slots), config.kv_dtype),
              "v": jnp.zeros((batch, kv, slots, h), config.kv_dtype)}

    return cls(layers=cache_collection(config, layer), lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len)

  @property
  def capacity(self) -> int:
    if self.max_len is not None:
      return self.max_len
    return max(layer["v"].shape[SEQ_AXIS["v"]] for layer in cache_layers(self.layers))

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    b, kv, h, s = self.lengths.shape[0], config.num_kv_heads, config.head_dim, config.cached_positions(layer, self.capacity)
    return {"k": ((b, kv, h, s), config.kv_dtype), "v": ((b, kv, s, h), config.kv_dtype)}

  def write(self, stored, k, v, span: Span):
    slots = write_slots(span, stored["v"].shape[SEQ_AXIS["v"]])
    return {"k": scatter_rows(stored["k"], k.swapaxes(2, 3), slots, SEQ_AXIS["k"]),
            "v": scatter_rows(stored["v"], v, slots, SEQ_AXIS["v"])}

  def read(self, stored, q, q_positions, span: Span, backend: Backend):
    """As KVCache.read; a one-token query is at its row's last position (every decode step, and
    the last layer of a call asking for each row's last logits)."""
    slots = stored["v"].shape[SEQ_AXIS["v"]]
    if q.shape[1] == 1:
      lengths = filled_through(q_positions[:, 0], slots, span.window)
      return backend.cache_attention(q, stored["k"], stored["v"], lengths, attend_one)
    held = span.positions[:, 0] + span.lengths
    mask = visible(q_positions, slot_positions(held, slots, span.window), span.window)  # [B, Tq, S]
    return attend(q, stored["k"], stored["v"], mask, k_transposed=True)

  def attend(self, stored, q, q_positions, k, v, span: Span, backend: Backend):
    if not span.window.size or span.from_empty or q.shape[1] == 1:
      return super().attend(stored, q, q_positions, k, v, span, backend)
    # A windowed layer's chunk may overwrite ring slots that its own earlier queries read, so the
    # queries read the ring as it was before the chunk, and the chunk's K/V beside it.
    slots = stored["v"].shape[SEQ_AXIS["v"]]
    before = visible(q_positions, ring_positions(span.positions[:, 0], slots, span.window), span.window)
    mask = jnp.concatenate([before, new_keys_mask(q_positions, span)], axis=2)  # [B, Tq, S + T]
    keys = jnp.concatenate([stored["k"], k.swapaxes(2, 3).astype(stored["k"].dtype)], axis=3)  # [B, K, H, S + T]
    values = jnp.concatenate([stored["v"], v.astype(stored["v"].dtype)], axis=2)  # [B, K, S + T, H]
    out = attend(q, keys, values, mask, k_transposed=True)
    return self.write(stored, k, v, span), out

  def resized(self, capacity: int) -> "ContiguousCache":
    """The same contents in buffers of `capacity` positions (at least what every row holds);
    a copy, as the literature's growing caches make (kvjax.decoding.baselines). Every layer must
    keep all its positions: a windowed layer's ring does not grow."""
    lengths = {layer["v"].shape[SEQ_AXIS["v"]] for layer in cache_layers(self.layers)}
    if lengths != {self.capacity}:
      raise ValueError(f"resized takes a cache whose every layer keeps its {self.capacity} positions; "
                       f"this one has windowed layers of {sorted(lengths - {self.capacity})} slots")

    def pad(x, axis):
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, capacity - x.shape[axis])
      return jnp.pad(x, widths)
    layers = jax.tree_util.tree_map_with_path(lambda path, x: pad(x, SEQ_AXIS[path[-1].key]), self.layers)
    return self.replace(layers=layers, max_len=capacity)
