"""The paged layout (PagedAttention): per-layer page pools addressed through page tables.

Shapes (the alphabet of kvjax.model.attention, plus):
  P pages in the pool, Z page size (tokens per page), M page-table width (pages per row).
  pool per layer and payload field (kvjax.cache.base): [heads, P, Z, W'] in the codec's dtype,
    head major (for K/V the layout of JAX's Pallas paged-attention kernels, so that kernel reads
    the pool without a copy); a quantized codec's scale pools [heads, P, Z] or [heads, P, Z, G].
  page_table int32[B, M]: entry j of row b is the page holding positions [j*Z, (j+1)*Z).

Page 0 is the null page (kvjax.cache.pages): the writes of padding columns and idle rows land
in it, and nothing read from it is ever used, since every read is masked to the row's valid
positions. Which pages a row owns is decided on the host by kvjax.serving.allocator; this module
is the device side. A windowed layer keeps every position in its pages, as a global one does;
its reads mask to the window and sinks (kvjax.model.keys.visible).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache.base import KVCache, encode, layer_arrays, scale_shape, size_bucket
from kvjax.cache.codec import Codec
from kvjax.cache.config import CacheConfig, register
from kvjax.cache.pages import NULL_PAGE
from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.model.attention import Span
from kvjax.model.keys import Visibility, attend
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_layers, cache_payload


def layer_spec(config: ModelConfig, codec: Codec, num_pages: int, page_size: int) -> dict:
  """{name: (shape, dtype)} of one layer's pools (module docstring)."""
  spec = {}
  for name, field in cache_payload(config).items():
    shape = (field.heads, num_pages, page_size, codec.stored_width(field.width))
    spec[name] = (shape, codec.stored_dtype)
    scales = scale_shape(shape, codec, field, 3)
    if scales is not None:
      spec[name + "_scale"] = (scales, jnp.dtype(jnp.float32))
  return spec


def gather(pool: jax.Array, page_table: jax.Array) -> jax.Array:
  """pool [heads, P, Z, ...], page_table int[B, M] -> [B, heads, M*Z, ...], each row's pages in
  sequence order (a value pool [heads, P, Z, W] or a scale pool [heads, P, Z] / [heads, P, Z, G])."""
  heads, _, page_size = pool.shape[:3]
  batch, width = page_table.shape
  pages = pool[:, page_table]  # [heads, B, M, Z, ...]
  return jnp.swapaxes(pages, 0, 1).reshape(batch, heads, width * page_size, *pool.shape[3:])


def attend_pages(q, k_pool, v_pool, lengths, page_table, k_scale=None, v_scale=None, *, codec: Codec):
  """XLA's one-token attention over K/V pages: q [B, 1, N, H] reads positions [0, lengths[b]] of
  its row's pages (page_table int[B, M]) -> [B, 1, N, H]. The gather copies each row's pages."""
  k = codec.decode(gather(k_pool, page_table), None if k_scale is None else gather(k_scale, page_table))
  v = codec.decode(gather(v_pool, page_table), None if v_scale is None else gather(v_scale, page_table))
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
  out = pallas_kernel()(
    scaled,
    k_pool,
    v_pool,
    page_table,
    lengths,
    k_splits=k_splits,
    pages_per_compute_block=per_block,
    interpret=interpret,
  )
  return out.astype(q.dtype)[:, None]


def check_pool(num_pages: int, page_size: int, batch: int, max_pages: int) -> None:
  """Raises ValueError naming the argument unless a paged cache of these sizes can exist."""
  for name, value in (("num_pages", num_pages), ("page_size", page_size), ("batch", batch), ("max_pages", max_pages)):
    check_positive_int(value, name)
  if num_pages < 2:
    raise ValueError(f"num_pages={num_pages} leaves no page besides the reserved null page")


def write_addresses(page_table: jax.Array, span: Span, page_size: int) -> tuple[jax.Array, jax.Array]:
  """(page, slot) int[B, T] of each new column: its row's page for the position, the null page
  for padding columns."""
  page_index = jnp.minimum(span.positions // page_size, page_table.shape[1] - 1)
  pages = jnp.where(span.valid, jnp.take_along_axis(page_table, page_index, axis=1), NULL_PAGE)
  return pages, span.positions % page_size


@register("paged")
class PagedCache(KVCache):
  """Page pools shared by all rows, a page table and lengths per row.

  paged_read (static): how a one-token K/V read goes: "gather" (the backend's decode route:
  kvjax's CPU kernel reads the pages in place, XLA gathers them), "pallas" (JAX's Pallas GPU
  kernel; see `pallas_available`) or "pallas_interpret" (that kernel interpreted, for checking
  it on the CPU). Longer queries, windowed layers and MLA payloads always gather.
  """

  page_table: jax.Array
  paged_read: str = flax.struct.field(pytree_node=False, default="gather")

  @classmethod
  def create(
    cls,
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    batch: int,
    max_pages: int,
    cache_config: CacheConfig = CacheConfig(),
  ) -> "PagedCache":
    """Empty pools of num_pages pages (page 0 is the null page) of page_size tokens, and `batch`
    rows of max_pages page-table entries, all pointing at the null page."""
    check_pool(num_pages, page_size, batch, max_pages)
    statics = cls.statics(config, cache_config)
    read = cache_config.paged_read
    if read == "pallas" and not pallas_available():
      raise ValueError(
        f"CacheConfig.paged_read='pallas' needs a GPU backend and JAX's Pallas paged-attention "
        f"kernel; the backend is {jax.default_backend()!r}"
      )
    if read == "pallas_interpret" and pallas_kernel() is None:
      raise ValueError(
        "CacheConfig.paged_read='pallas_interpret' needs JAX's Pallas paged-attention kernel, which this JAX lacks"
      )
    if read != "gather" and config.is_latent:
      raise ValueError(f"CacheConfig.paged_read={read!r} reads K/V pools; an MLA model's pages are read by 'gather'")
    memory.check_fits(
      f"a paged cache of {num_pages} pages x {page_size} tokens",
      cls.pool_bytes(config, cache_config, num_pages, page_size, batch, max_pages),
    )
    spec = layer_spec(config, statics["codec"], num_pages, page_size)
    return cls(
      layers=cache_collection(config, lambda i: layer_arrays(spec)),
      lengths=jnp.zeros((batch,), jnp.int32),
      page_table=jnp.zeros((batch, max_pages), jnp.int32),
      paged_read=read,
      **statics,
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
  ) -> "PagedCache":
    """A cache of `batch` rows of max_len positions each, row b owning pages [1 + b*M, 1 + (b+1)*M)
    of cache_config.page_size tokens (M = ceil(max_len / page_size)): what prefill and generate
    make for layout="paged" (the engine allocates its pages itself). With `bucket`, M covers
    size_bucket(max_len) positions and `limit` is max_len."""
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    model = cache_config.model(config)
    model.check_length(max_len, f"a cache of max_len={max_len} positions")
    storage = size_bucket(max_len, model.max_positions) if bucket else max_len
    width = -(-storage // cache_config.page_size)
    empty = cls.create(config, 1 + batch * width, cache_config.page_size, batch, width, cache_config)
    table = np.arange(1, 1 + batch * width, dtype=np.int32).reshape(batch, width)
    return empty.replace(page_table=jnp.asarray(table), limit=jnp.asarray(max_len, jnp.int32) if bucket else None)

  @classmethod
  def pool_bytes(
    cls, config: ModelConfig, cache_config: CacheConfig, num_pages: int, page_size: int, batch: int, max_pages: int
  ) -> int:
    """Bytes of create(...): the page pools, the int32 page table and lengths."""
    return num_pages * page_size * cls.sequence_bytes(config, cache_config, 1) + 4 * batch * (max_pages + 1)

  @classmethod
  def bytes_for(
    cls, config: ModelConfig, cache_config: CacheConfig, batch: int, max_len: int, prompt: int | None = None
  ) -> int:
    """Bytes of rows(config, batch, max_len, cache_config)."""
    width = -(-max_len // cache_config.page_size)
    return cls.pool_bytes(config, cache_config, 1 + batch * width, cache_config.page_size, batch, width)

  @property
  def num_pages(self) -> int:
    return next(iter(cache_layers(self.layers)[0].values())).shape[1]  # every pool is [heads, P, Z, ...]

  @property
  def page_size(self) -> int:
    return next(iter(cache_layers(self.layers)[0].values())).shape[2]

  @property
  def storage_positions(self) -> int:
    return self.page_table.shape[1] * self.page_size

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.codec, self.num_pages, self.page_size)

  def partition_rule(self, name: str) -> tuple:
    return ("model",) if name == "layers" else ("data",)

  def with_rows(self, page_table, lengths, filled=None) -> "PagedCache":
    """The same pools addressed by another batch of rows: page_table int[B', M'], lengths int[B']
    (tokens each row already holds in its pages). filled, the slots each row holds, is the paged
    evicting layout's (kvjax.cache.layouts.paged_evict); a paged row holds every position, so lengths."""
    return self.replace(page_table=jnp.asarray(page_table, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32))

  def check_room(self, new_lengths: np.ndarray) -> None:
    """Every row must own a real page (not the null page, inside the pool) for each position it
    will hold: gathers clamp out-of-range indices, so a bad table must never reach the device."""
    if self.limit is not None:
      super().check_room(new_lengths)  # the positions asked for, fewer than the pages hold
    table = np.asarray(self.page_table)
    needed = np.asarray(self.lengths) + new_lengths
    if ((table < 0) | (table >= self.num_pages)).any():
      row, col = map(int, np.argwhere((table < 0) | (table >= self.num_pages))[0])
      raise ValueError(
        f"page_table[{row}, {col}]={int(table[row, col])} is outside the pool's [0, {self.num_pages}) pages"
      )
    if (needed > self.capacity).any():
      row = int(np.argmax(needed > self.capacity))
      raise ValueError(
        f"row {row} needs {int(needed[row])} positions but the page table holds "
        f"{table.shape[1]} pages of {self.page_size} = {self.capacity}"
      )
    used = np.arange(table.shape[1])[None, :] < -(-needed[:, None] // self.page_size)
    if (used & (table == NULL_PAGE)).any():
      row, col = map(int, np.argwhere(used & (table == NULL_PAGE))[0])
      raise ValueError(
        f"row {row} has no page for positions [{col * self.page_size}, "
        f"{(col + 1) * self.page_size}): page_table[{row}, {col}] is the null page"
      )

  def write(self, stored, new, span: Span):
    page_size = next(iter(stored.values())).shape[2]  # inside the model the arrays are in `stored`, not layers
    pages, slots = write_addresses(self.page_table, span, page_size)
    # x [B, heads, T, ...] -> the pool's [heads, B, T, ...] at each column's page and slot.
    return {
      name: stored[name].at[:, pages, slots].set(jnp.swapaxes(x, 0, 1).astype(stored[name].dtype), mode="drop")
      for name, x in encode(self.codec, new).items()
    }

  def read(self, stored, query, q_positions, span: Span, backend: Backend):
    if q_positions.shape[1] == 1 and not span.window.size and query.kernel_query is not None:
      q = query.kernel_query
      if self.paged_read != "gather":
        return pallas_attend(
          q,
          stored["k"],
          stored["v"],
          self.page_table,
          q_positions[:, 0] + 1,
          interpret=self.paged_read == "pallas_interpret",
        )
      return backend.cache_attention(
        self.route,
        q,
        stored["k"],
        stored["v"],
        q_positions[:, 0],
        functools.partial(attend_pages, codec=self.codec),
        page_table=self.page_table,
        **self.scales(stored),
      )
    gathered = {name: gather(x, self.page_table) for name, x in stored.items()}  # [B, heads, M*Z, ...]
    arrays = self.decoded(gathered, dict.fromkeys(self.fields, -1))
    positions = jnp.arange(next(iter(gathered.values())).shape[2])[None, :]
    return query.attend(arrays, Visibility(q_positions, positions, span.window), absorb=self.absorb, backend=backend)

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
