"""The contiguous cache: every row preallocates max_len positions per layer.

Per layer k [B, K, H, S] and v [B, K, S, H] in config.cache_dtype, kv-head major, so each
(row, kv head) pair reads one contiguous block per decode step; keys are stored transposed so
that the decode scores are a plain [G, H] x [H, S] product with S contiguous (the
sequence-major layout [B, S, K, H] makes XLA's CPU dot transpose the whole cache every step).
New K/V are scattered into place (`write_rows`), in place since the cache is donated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache.base import KVCache, write_rows
from kvjax.config import ModelConfig, check_positive_int
from kvjax.model.attention import Span, attend
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_layers

# The sequence axis of each buffer: k [B, K, H, S], v [B, K, S, H].
SEQ_AXIS = {"k": 3, "v": 2}


def attend_one(q, k_cache, v_cache, lengths):
  """XLA's one-token attention over the buffers: q [B, 1, N, H] reads positions [0, lengths[b]]."""
  mask = (jnp.arange(v_cache.shape[SEQ_AXIS["v"]])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
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
    kv, h = config.num_kv_heads, config.head_dim
    layer = lambda i: {"k": jnp.zeros((batch, kv, h, max_len), config.kv_dtype),
                       "v": jnp.zeros((batch, kv, max_len, h), config.kv_dtype)}
    return cls(layers=cache_collection(config, layer), lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return cache_layers(self.layers)[0]["v"].shape[SEQ_AXIS["v"]]

  def layer_spec(self, config: ModelConfig):
    b, kv, h, s = self.lengths.shape[0], config.num_kv_heads, config.head_dim, self.capacity
    return {"k": ((b, kv, h, s), config.kv_dtype), "v": ((b, kv, s, h), config.kv_dtype)}

  def write(self, stored, k, v, span: Span):
    starts = span.positions[:, 0]
    return {"k": write_rows(stored["k"], k.swapaxes(2, 3), starts, span.lengths, SEQ_AXIS["k"]),
            "v": write_rows(stored["v"], v, starts, span.lengths, SEQ_AXIS["v"])}

  def read(self, stored, q, q_positions, span: Span, backend: Backend):
    if q.shape[1] == 1:
      return backend.cache_attention(q, stored["k"], stored["v"], q_positions[:, 0], attend_one)
    s = stored["v"].shape[SEQ_AXIS["v"]]
    mask = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, Tq, S]
    return attend(q, stored["k"], stored["v"], mask, k_transposed=True)

  def resized(self, capacity: int) -> "ContiguousCache":
    """The same contents in buffers of `capacity` positions (at least what every row holds);
    a copy, as the literature's growing caches make (kvjax.decoding.baselines)."""
    def pad(x, axis):
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, capacity - x.shape[axis])
      return jnp.pad(x, widths)
    layers = jax.tree_util.tree_map_with_path(lambda path, x: pad(x, SEQ_AXIS[path[-1].key]), self.layers)
    return self.replace(layers=layers)
