"""The paged cache (PagedAttention): per-layer page pools addressed through page tables.

Shapes (the alphabet of kvjax.model.attention, plus):
  P pages in the pool, Z page size (tokens per page), M page-table width (pages per row).
  pool k, v per layer: [K, P, Z, H] in config.cache_dtype, kv-head major (the layout of JAX's
    Pallas paged-attention kernels, so that kernel reads the pool without a copy).
  page_table int32[B, M]: entry j of row b is the page holding positions [j*Z, (j+1)*Z).
  A quantized format (kvjax.cache.quant) stores its values in the same pools (H/2 bytes for
  packed int4) and float32 scale pools k_scale, v_scale [K, P, Z] ([K, P, Z, G] for int4).

Page 0 is the null page (kvjax.cache.pages): the writes of padding columns and idle rows land
in it, and nothing read from it is ever used, since every read is masked to the row's valid
positions. Which pages a row owns is decided on the host by
kvjax.serving.allocator; this module is the device side.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache import quant
from kvjax.cache.base import KVCache, layer_arrays, scales, stored_format
from kvjax.cache.pages import NULL_PAGE
from kvjax.config import ModelConfig, cache_scale_groups, check_positive_int
from kvjax.model.attention import Span, attend, visible
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_layers

ATTENTION_IMPLS = ("gather", "pallas", "pallas_interpret")


def layer_spec(config: ModelConfig, num_pages: int, page_size: int) -> dict:
  """{name: (shape, dtype)} of one layer's pools: k, v [K, P, Z, H'] and, quantized, their scales."""
  kv, dtype = config.num_kv_heads, config.kv_dtype
  h = config.head_dim // 2 if config.cache_dtype == "int4" else config.head_dim
  spec = {"k": ((kv, num_pages, page_size, h), dtype), "v": ((kv, num_pages, page_size, h), dtype)}
  if config.cache_quantized:
    groups = cache_scale_groups(config.cache_dtype, config.head_dim)
    shape = (kv, num_pages, page_size) + ((groups,) if config.cache_dtype == "int4" else ())
    spec["k_scale"] = spec["v_scale"] = (shape, jnp.dtype(jnp.float32))
  return spec


def gather(pool: jax.Array, page_table: jax.Array) -> jax.Array:
  """pool [K, P, Z, ...], page_table int[B, M] -> [B, K, M*Z, ...], each row's pages in sequence
  order (a value pool [K, P, Z, H] or a scale pool [K, P, Z] / [K, P, Z, G])."""
  num_kv_heads, _, page_size = pool.shape[:3]
  batch, width = page_table.shape
  pages = pool[:, page_table]  # [K, B, M, Z, ...]
  return jnp.swapaxes(pages, 0, 1).reshape(batch, num_kv_heads, width * page_size, *pool.shape[3:])


def gathered(k_pool, v_pool, page_table, k_scale=None, v_scale=None):
  """Each row's keys and values in sequence order, k and v [B, K, M*Z, H], dequantized to
  float32 when the pools are quantized (the scales given)."""
  k, v = gather(k_pool, page_table), gather(v_pool, page_table)
  if k_scale is None:
    return k, v
  fmt = quant.format_of(k_pool.dtype)
  return (quant.dequantize(k, gather(k_scale, page_table), fmt),
          quant.dequantize(v, gather(v_scale, page_table), fmt))


def attend_pages(q, k_pool, v_pool, lengths, page_table, k_scale=None, v_scale=None):
  """XLA's one-token attention over the pages: q [B, 1, N, H] reads positions [0, lengths[b]] of
  its row's pages (page_table int[B, M]) -> [B, 1, N, H]. The gather copies each row's pages."""
  k, v = gathered(k_pool, v_pool, page_table, k_scale, v_scale)
  mask = (jnp.arange(k.shape[2])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, M*Z]
  return attend(q, k, v, mask)


def pallas_kernel():
  """JAX's Pallas GPU paged-attention kernel, or None where this JAX does not ship it."""
  try:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
  except ImportError:
    return None
  return paged_attention


def pallas_available() -> bool:
  """True when JAX's Pallas paged-attention kernel is importable and a GPU backend is present."""
  return jax.default_backend() == "gpu" and pallas_kernel() is not None


def pallas_attend(q, k_pool, v_pool, page_table, lengths, interpret: bool):
  """The Pallas kernel on one query per row: q [B, 1, N, H], lengths = positions to read -> [B, 1, N, H].
  The kernel does not scale scores and computes in the pool's dtype."""
  width = page_table.shape[1]
  k_splits = max(d for d in range(1, min(16, width) + 1) if width % d == 0)
  per_split = width // k_splits
  per_block = max(d for d in range(1, min(8, per_split) + 1) if per_split % d == 0)
  scaled = (q[:, 0] * q.shape[-1] ** -0.5).astype(k_pool.dtype)  # [B, N, H]
  out = pallas_kernel()(scaled, k_pool, v_pool, page_table, lengths, k_splits=k_splits,
                        pages_per_compute_block=per_block, interpret=interpret)
  return out.astype(q.dtype)[:, None]


def check_pool(num_pages: int, page_size: int, batch: int, max_pages: int) -> None:
  """Raises ValueError naming the argument unless a paged cache of these sizes can exist."""
  for name, value in (("num_pages", num_pages), ("page_size", page_size), ("batch", batch),
                      ("max_pages", max_pages)):
    check_positive_int(value, name)
  if num_pages < 2:
    raise ValueError(f"num_pages={num_pages} leaves no page besides the reserved null page")


def write_addresses(page_table: jax.Array, span: Span, page_size: int) -> tuple[jax.Array, jax.Array]:
  """(page, slot) int[B, T] of each new column: its row's page for the position, the null page
  for padding columns."""
  page_index = jnp.minimum(span.positions // page_size, page_table.shape[1] - 1)
  pages = jnp.where(span.valid, jnp.take_along_axis(page_table, page_index, axis=1), NULL_PAGE)
  return pages, span.positions % page_size


class PagedCache(KVCache):
  """Page pools shared by all rows, a page table and lengths per row.

  attention (static): how a decode step reads the pages: "gather" (the backend's cache_attention:
  kvjax's CPU kernel reads the pages in place, XLA gathers them), "pallas"
  (JAX's Pallas GPU kernel; see `pallas_available`) or "pallas_interpret" (that kernel
  interpreted, for checking it on the CPU). Longer queries, and the queries of a sliding-window
  layer, always gather.

  A windowed layer (ModelConfig.window) keeps every position in its pages, as a global one does;
  its reads mask to the window and sinks (kvjax.model.attention.visible).
  """

  page_table: jax.Array
  attention: str = flax.struct.field(pytree_node=False, default="gather")

  @classmethod
  def create(cls, config: ModelConfig, num_pages: int, page_size: int, batch: int, max_pages: int,
             attention: str = "gather") -> "PagedCache":
    """Empty pools of num_pages pages (page 0 is the null page) of page_size tokens, and `batch`
    rows of max_pages page-table entries, all pointing at the null page."""
    check_pool(num_pages, page_size, batch, max_pages)
    if attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    if attention != "gather" and config.cache_quantized:
      raise ValueError(f"attention={attention!r} reads float pools only; a cache_dtype={config.cache_dtype!r} "
                       "cache takes attention='gather'")
    if attention == "pallas" and not pallas_available():
      raise ValueError(f"attention='pallas' needs a GPU backend and JAX's Pallas paged-attention kernel; "
                       f"the backend is {jax.default_backend()!r}")
    if attention == "pallas_interpret" and pallas_kernel() is None:
      raise ValueError("attention='pallas_interpret' needs JAX's Pallas paged-attention kernel, which this JAX lacks")
    memory.check_fits(f"a paged cache of {num_pages} pages x {page_size} tokens",
                      memory.paged_cache_bytes(config, num_pages, page_size, batch, max_pages))
    spec = layer_spec(config, num_pages, page_size)
    return cls(layers=cache_collection(config, lambda i: layer_arrays(spec)), lengths=jnp.zeros((batch,), jnp.int32),
               page_table=jnp.zeros((batch, max_pages), jnp.int32), attention=attention)

  @property
  def num_pages(self) -> int:
    return next(iter(cache_layers(self.layers)[0].values())).shape[1]  # every pool is [heads, P, Z, ...]

  @property
  def page_size(self) -> int:
    return next(iter(cache_layers(self.layers)[0].values())).shape[2]

  @property
  def capacity(self) -> int:
    return self.page_table.shape[1] * self.page_size

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.num_pages, self.page_size)

  def with_rows(self, page_table, lengths) -> "PagedCache":
    """The same pools addressed by another batch of rows: page_table int[B', M'], lengths int[B']
    (tokens each row already holds in its pages)."""
    return self.replace(page_table=jnp.asarray(page_table, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32))

  def check_room(self, new_lengths: np.ndarray) -> None:
    """Every row must own a real page (not the null page, inside the pool) for each position it
    will hold: gathers clamp out-of-range indices, so a bad table must never reach the device."""
    table = np.asarray(self.page_table)
    needed = np.asarray(self.lengths) + new_lengths
    if ((table < 0) | (table >= self.num_pages)).any():
      row, col = map(int, np.argwhere((table < 0) | (table >= self.num_pages))[0])
      raise ValueError(f"page_table[{row}, {col}]={int(table[row, col])} is outside the pool's "
                       f"[0, {self.num_pages}) pages")
    if (needed > self.capacity).any():
      row = int(np.argmax(needed > self.capacity))
      raise ValueError(f"row {row} needs {int(needed[row])} positions but the page table holds "
                       f"{table.shape[1]} pages of {self.page_size} = {self.capacity}")
    used = np.arange(table.shape[1])[None, :] < -(-needed[:, None] // self.page_size)
    if (used & (table == NULL_PAGE)).any():
      row, col = map(int, np.argwhere(used & (table == NULL_PAGE))[0])
      raise ValueError(f"row {row} has no page for positions [{col * self.page_size}, "
                       f"{(col + 1) * self.page_size}): page_table[{row}, {col}] is the null page")

  def write(self, stored, k, v, span: Span):
    pages, slots = write_addresses(self.page_table, span, stored["k"].shape[2])
    store = lambda pool, new: pool.at[:, pages, slots].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype))  # [K, B, T, ...]
    new = quant.encode(k, v, stored_format(stored))  # [B, K, T, ...]
    return {name: store(stored[name], x) for name, x in new.items()}

  def read(self, stored, q, q_positions, span: Span, backend: Backend):
    if q.shape[1] == 1 and not span.window.size:
      if self.attention != "gather":
        return pallas_attend(q, stored["k"], stored["v"], self.page_table, q_positions[:, 0] + 1,
                             interpret=self.attention == "pallas_interpret")
      return backend.cache_attention(q, stored["k"], stored["v"], q_positions[:, 0], attend_pages,
                                     page_table=self.page_table, **scales(stored))
    k, v = gathered(stored["k"], stored["v"], self.page_table, **scales(stored))
    mask = visible(q_positions, jnp.arange(k.shape[2])[None, :], span.window)  # [B, Tq, M*Z]
    return attend(q, k, v, mask)

  def copy_pages(self, src, dst) -> "PagedCache":
    """Copies pages src[i] -> dst[i] in every pool (copy-on-write after a fork). src, dst int[C]."""
    src, dst = np.asarray(src, np.int32).reshape(-1), np.asarray(dst, np.int32).reshape(-1)
    if src.shape != dst.shape:
      raise ValueError(f"copy_pages needs as many sources as destinations, got {src.size} and {dst.size}")
    if src.size == 0:
      return self
    both = np.concatenate([src, dst])
    if ((both <= NULL_PAGE) | (both >= self.num_pages)).any():
      raise ValueError(f"copy_pages indices must be real pages in [1, {self.num_pages}), got {src} -> {dst}")
    return self.replace(layers=_copy_pages(self.layers, jnp.asarray(src), jnp.asarray(dst)))


@functools.partial(jax.jit, donate_argnames=("layers",))
def _copy_pages(layers, src, dst):
  return jax.tree.map(lambda pool: pool.at[:, dst].set(pool[:, src]), layers)
