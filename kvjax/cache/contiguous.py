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

A quantized format (config.cache_dtype int8 / int4 / float8_e4m3fn, kvjax.cache.quant) keeps the
layout: k [B, K, H', S] and v [B, K, S, H'] hold the quantized values (H' = H/2 bytes for packed
int4), with float32 k_scale [B, K, S] and v_scale [B, K, S] beside them (int4: k_scale
[B, K, G, S] and v_scale [B, K, S, G], G scale groups along the head dim). A ring's scales sit in
the same slots as its values; every read dequantizes them (int8 one-token reads in the CPU kernel).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache import quant
from kvjax.cache.base import KVCache, as_stored, layer_arrays, scales, scatter_rows, stored_format
from kvjax.config import ModelConfig, cache_scale_groups, check_positive_int
from kvjax.model.attention import Span, Window, attend, new_keys_mask, visible
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_layers

V_SEQ_AXIS = 2  # v [B, K, S, H] and v_scale; keys and their scales hold the sequence last


def seq_axis(name: str, ndim: int) -> int:
  """The sequence axis of a stored array: the last for k [B, K, H, S] and k_scale, 2 for v [B, K, S, H]
  and v_scale."""
  return ndim - 1 if name.startswith("k") else V_SEQ_AXIS


def layer_spec(config: ModelConfig, batch: int, capacity: int) -> dict:
  """{name: (shape, dtype)} of one layer of a contiguous cache of `batch` rows x `capacity` positions."""
  b, kv, s, dtype = batch, config.num_kv_heads, capacity, config.kv_dtype
  h = config.head_dim // 2 if config.cache_dtype == "int4" else config.head_dim
  spec = {"k": ((b, kv, h, s), dtype), "v": ((b, kv, s, h), dtype)}
  if config.cache_quantized:
    groups = cache_scale_groups(config.cache_dtype, config.head_dim)
    group_axis = (groups,) if config.cache_dtype == "int4" else ()
    spec["k_scale"] = ((b, kv, *group_axis, s), jnp.dtype(jnp.float32))
    spec["v_scale"] = ((b, kv, s, *group_axis), jnp.dtype(jnp.float32))
  return spec


def dequantized(k_cache, v_cache, k_scale, v_scale):
  """The float32 k [B, K, H, S] and v [B, K, S, H] a quantized layer holds."""
  fmt = quant.format_of(k_cache.dtype)
  return quant.dequantize(k_cache, k_scale, fmt, axis=2), quant.dequantize(v_cache, v_scale, fmt, axis=-1)


def readable(stored: dict) -> tuple[jax.Array, jax.Array]:
  """One layer's k [B, K, H, S] and v [B, K, S, H] as a read sees them: dequantized to float32
  for a quantized format, else as stored."""
  if stored_format(stored) is None:
    return stored["k"], stored["v"]
  return dequantized(stored["k"], stored["v"], stored["k_scale"], stored["v_scale"])


def attend_one(q, k_cache, v_cache, lengths, k_scale=None, v_scale=None):
  """XLA's one-token attention over the buffers: q [B, 1, N, H] reads positions [0, lengths[b]];
  a quantized cache's buffers are dequantized with their scales first."""
  if k_scale is not None:
    k_cache, v_cache = dequantized(k_cache, v_cache, k_scale, v_scale)
  mask = (jnp.arange(v_cache.shape[V_SEQ_AXIS])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
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

    def layer(i):
      return layer_arrays(layer_spec(config, batch, config.cached_positions(i, max_len)))

    return cls(layers=cache_collection(config, layer), lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len)

  @property
  def capacity(self) -> int:
    if self.max_len is not None:
      return self.max_len
    return max(layer["v"].shape[V_SEQ_AXIS] for layer in cache_layers(self.layers))

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.lengths.shape[0], config.cached_positions(layer, self.capacity))

  def write(self, stored, k, v, span: Span):
    slots = write_slots(span, stored["v"].shape[V_SEQ_AXIS])
    new = quant.encode(k, v, stored_format(stored))  # [B, K, T, ...]
    out = {}
    for name, x in new.items():
      if name.startswith("k") and x.ndim == 4:
        x = x.swapaxes(2, 3)  # keys (and int4 key scales) hold the sequence last
      out[name] = scatter_rows(stored[name], x, slots, seq_axis(name, x.ndim))
    return out

  def read(self, stored, q, q_positions, span: Span, backend: Backend):
    """As KVCache.read; a one-token query is at its row's last position (every decode step, and
    the last layer of a call asking for each row's last logits)."""
    slots = stored["v"].shape[V_SEQ_AXIS]
    if q.shape[1] == 1:
      lengths = filled_through(q_positions[:, 0], slots, span.window)
      return backend.cache_attention(q, stored["k"], stored["v"], lengths, attend_one, **scales(stored))
    held = span.positions[:, 0] + span.lengths
    mask = visible(q_positions, slot_positions(held, slots, span.window), span.window)  # [B, Tq, S]
    return attend(q, *readable(stored), mask, k_transposed=True)

  def attend(self, stored, q, q_positions, k, v, span: Span, backend: Backend):
    if not span.window.size or span.from_empty or q.shape[1] == 1:
      return super().attend(stored, q, q_positions, k, v, span, backend)
    # A windowed layer's chunk may overwrite ring slots that its own earlier queries read, so the
    # queries read the ring as it was before the chunk, and the chunk's K/V beside it.
    # A quantized ring is read dequantized, the chunk's K/V as the ring will hold them (as_stored).
    slots = stored["v"].shape[V_SEQ_AXIS]
    before = visible(q_positions, ring_positions(span.positions[:, 0], slots, span.window), span.window)
    mask = jnp.concatenate([before, new_keys_mask(q_positions, span)], axis=2)  # [B, Tq, S + T]
    k_old, v_old = readable(stored)
    new_k, new_v = as_stored(k, stored).astype(k_old.dtype), as_stored(v, stored).astype(v_old.dtype)
    keys = jnp.concatenate([k_old, new_k.swapaxes(2, 3)], axis=3)  # [B, K, H, S + T]
    values = jnp.concatenate([v_old, new_v], axis=2)  # [B, K, S + T, H]
    out = attend(q, keys, values, mask, k_transposed=True)
    return self.write(stored, k, v, span), out

  def resized(self, capacity: int) -> "ContiguousCache":
    """The same contents in buffers of `capacity` positions (at least what every row holds);
    a copy, as the literature's growing caches make (kvjax.decoding.baselines). Every layer must
    keep all its positions: a windowed layer's ring does not grow."""
    lengths = {layer["v"].shape[V_SEQ_AXIS] for layer in cache_layers(self.layers)}
    if lengths != {self.capacity}:
      raise ValueError(f"resized takes a cache whose every layer keeps its {self.capacity} positions; "
                       f"this one has windowed layers of {sorted(lengths - {self.capacity})} slots")

    def pad(x, axis):
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, capacity - x.shape[axis])
      return jnp.pad(x, widths)
    layers = jax.tree_util.tree_map_with_path(lambda path, x: pad(x, seq_axis(path[-1].key, x.ndim)), self.layers)
    return self.replace(layers=layers, max_len=capacity)
