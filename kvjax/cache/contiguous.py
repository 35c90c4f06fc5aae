"""The contiguous cache: every row preallocates max_len positions per layer.

Per layer k [B, K, H, S] and v [B, K, S, H] in config.cache_dtype, kv-head major, so each
(row, kv head) pair reads one contiguous block per decode step; keys are stored transposed so
that the decode scores are a plain [G, H] x [H, S] product with S contiguous (the
sequence-major layout [B, S, K, H] makes XLA's CPU dot transpose the whole cache every step).
New K/V are scattered into place (`write_rows`), in place since the cache is donated.

A quantized format (config.cache_dtype int8 / int4 / float8_e4m3fn, kvjax.cache.quant) keeps the
layout: k [B, K, H', S] and v [B, K, S, H'] hold the quantized values (H' = H/2 bytes for packed
int4), with float32 k_scale [B, K, S] and v_scale [B, K, S] beside them (int4: k_scale
[B, K, G, S] and v_scale [B, K, S, G], G scale groups along the head dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache import quant
from kvjax.cache.base import KVCache, layer_arrays, scales, stored_format, write_rows
from kvjax.config import ModelConfig, cache_scale_groups, check_positive_int
from kvjax.model.attention import Span, attend
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


def attend_one(q, k_cache, v_cache, lengths, k_scale=None, v_scale=None):
  """XLA's one-token attention over the buffers: q [B, 1, N, H] reads positions [0, lengths[b]];
  a quantized cache's buffers are dequantized with their scales first."""
  if k_scale is not None:
    k_cache, v_cache = dequantized(k_cache, v_cache, k_scale, v_scale)
  mask = (jnp.arange(v_cache.shape[V_SEQ_AXIS])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
  return attend(q, k_cache, v_cache, mask, k_transposed=True)


class ContiguousCache(KVCache):
  """Preallocated per-row buffers; see the module docstring for the layout."""

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_len: int) -> "ContiguousCache":
    """An empty cache of `batch` rows with room for max_len positions each (at most ModelConfig.max_len)."""
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    if max_len > config.max_len:
      raise ValueError(f"cache length max_len={max_len} exceeds ModelConfig.max_len={config.max_len}")
    memory.check_fits(f"a contiguous cache of {batch} rows x {max_len} positions",
                      memory.contiguous_cache_bytes(config, batch, max_len))
    spec = layer_spec(config, batch, max_len)
    return cls(layers=cache_collection(config, lambda i: layer_arrays(spec)), lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return cache_layers(self.layers)[0]["v"].shape[V_SEQ_AXIS]

  def layer_spec(self, config: ModelConfig):
    return layer_spec(config, self.lengths.shape[0], self.capacity)

  def write(self, stored, k, v, span: Span):
    starts = span.positions[:, 0]
    new = quant.encode(k, v, stored_format(stored))  # [B, K, T, ...]
    out = {}
    for name, x in new.items():
      if name.startswith("k") and x.ndim == 4:
        x = x.swapaxes(2, 3)  # keys (and int4 key scales) hold the sequence last
      out[name] = write_rows(stored[name], x, starts, span.lengths, seq_axis(name, x.ndim))
    return out

  def read(self, stored, q, q_positions, span: Span, backend: Backend):
    if q.shape[1] == 1:
      return backend.cache_attention(q, stored["k"], stored["v"], q_positions[:, 0], attend_one, **scales(stored))
    k, v = stored["k"], stored["v"]
    if stored_format(stored) is not None:
      k, v = dequantized(k, v, stored["k_scale"], stored["v_scale"])
    mask = jnp.arange(v.shape[V_SEQ_AXIS])[None, None, :] <= q_positions[:, :, None]  # [B, Tq, S]
    return attend(q, k, v, mask, k_transposed=True)

  def resized(self, capacity: int) -> "ContiguousCache":
    """The same contents in buffers of `capacity` positions (at least what every row holds);
    a copy, as the literature's growing caches make (kvjax.decoding.baselines)."""
    def pad(x, axis):
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, capacity - x.shape[axis])
      return jnp.pad(x, widths)
    layers = jax.tree_util.tree_map_with_path(lambda path, x: pad(x, seq_axis(path[-1].key, x.ndim)), self.layers)
    return self.replace(layers=layers)
