"""The latent caches of multi-head latent attention (kvjax.model.mla): per token one latent
c [R] and one rotary key [rope_dims], whatever the number of heads.

  LatentCache       contiguous: per layer latent [B, S, R] and rope_key [B, S, rope_dims], every
                    row preallocating its positions; writes are `write_rows` scatters.
  PagedLatentCache  paged: per layer pools latent [1, P, Z, R] and rope_key [1, P, Z, rope_dims]
                    addressed by the page table of kvjax.cache.paged (whose host-side checks,
                    row addressing and page copies it shares); the leading axis of 1 is the
                    paged pools' kv-head axis, here one latent shared by all heads.
A decode step reads the stored latents in the absorbed form (LatentQuery.absorbed: no per-head
K/V is formed); a call from an empty cache attends to its own latents in the expanded form, as
training does. `absorb=False` reads the cache expanded too, the oracle the tests compare with.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache.base import KVCache, write_rows
from kvjax.cache.paged import PagedCache, check_pool, gather, write_addresses
from kvjax.config import ModelConfig, check_positive_int
from kvjax.model.attention import Span, new_keys_mask
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_layers


def _widths(config: ModelConfig) -> dict[str, int]:
  return {"latent": config.kv_latent_rank, "rope_key": config.rope_dims}


def _check_latent_model(config: ModelConfig, kind: str) -> None:
  if not config.is_latent:
    raise ValueError(f"a {kind} holds multi-head latent attention; the model has kv_latent_rank=0 "
                     "(use ContiguousCache or PagedCache)")


class LatentAttend:
  """The device side both latent kinds share: write, then read absorbed (or expanded)."""

  def attend_latent(self, stored: dict, query, q_positions, latent, rope_key, span: Span, backend: Backend):
    """What an MLA layer calls: stores this call's latent [B, T, R] and rope_key [B, T, K*W],
    then query (a LatentQuery at q_positions int[B, Tq]) attends -> (new arrays, [B, Tq, N, H])."""
    stored = self.write(stored, latent, rope_key, span)
    if span.from_empty:
      return stored, query.expanded(latent, rope_key, new_keys_mask(q_positions, span))
    return stored, self.read(stored, query, q_positions, span, backend)

  def read_rows(self, query, q_positions, latent, rope_key):
    """query reads latent [B, S, R] and rope_key [B, S, K*W] up to its positions."""
    mask = jnp.arange(latent.shape[1])[None, None, :] <= q_positions[:, :, None]  # [B, Tq, S]
    return (query.absorbed if self.absorb else query.expanded)(latent, rope_key, mask)


class LatentCache(LatentAttend, KVCache):
  """Preallocated per-row latents and rotary keys; see the module docstring."""

  absorb: bool = flax.struct.field(pytree_node=False, default=True)
  latent = True

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_len: int, absorb: bool = True) -> "LatentCache":
    """An empty cache of `batch` rows with room for max_len positions each (at most ModelConfig.max_len)."""
    _check_latent_model(config, cls.__name__)
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    config.check_length(max_len, f"a cache of max_len={max_len} positions")
    memory.check_fits(f"a latent cache of {batch} rows x {max_len} positions",
                      memory.contiguous_cache_bytes(config, batch, max_len))
    layer = lambda i: {name: jnp.zeros((batch, max_len, width), config.kv_dtype)
                       for name, width in _widths(config).items()}
    return cls(layers=cache_collection(config, layer), lengths=jnp.zeros((batch,), jnp.int32), absorb=absorb)

  @property
  def capacity(self) -> int:
    return cache_layers(self.layers)[0]["latent"].shape[1]

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    b, s = self.lengths.shape[0], self.capacity
    return {name: ((b, s, width), config.kv_dtype) for name, width in _widths(config).items()}

  def write(self, stored, latent, rope_key, span: Span):
    starts = span.positions[:, 0]
    return {"latent": write_rows(stored["latent"], latent, starts, span.lengths, 1),
            "rope_key": write_rows(stored["rope_key"], rope_key, starts, span.lengths, 1)}

  def read(self, stored, query, q_positions, span: Span, backend: Backend):
    return self.read_rows(query, q_positions, stored["latent"], stored["rope_key"])


class PagedLatentCache(LatentAttend, PagedCache):
  """Latent page pools shared by all rows; see the module docstring. Reads gather the row's pages."""

  absorb: bool = flax.struct.field(pytree_node=False, default=True)
  latent = True

  @classmethod
  def create(cls, config: ModelConfig, num_pages: int, page_size: int, batch: int, max_pages: int,
             attention: str = "gather", absorb: bool = True) -> "PagedLatentCache":
    """Empty pools of num_pages pages (page 0 is the null page) of page_size tokens, and `batch`
    rows of max_pages page-table entries, all pointing at the null page. attention must be
    "gather" (the Pallas kernels read K/V pools)."""
    _check_latent_model(config, cls.__name__)
    check_pool(num_pages, page_size, batch, max_pages)
    if attention != "gather":
      raise ValueError(f"a PagedLatentCache reads its pages by attention='gather', got {attention!r}")
    memory.check_fits(f"a paged latent cache of {num_pages} pages x {page_size} tokens",
                      memory.paged_cache_bytes(config, num_pages, page_size, batch, max_pages))
    layer = lambda i: {name: jnp.zeros((1, num_pages, page_size, width), config.kv_dtype)
                       for name, width in _widths(config).items()}
    return cls(layers=cache_collection(config, layer), lengths=jnp.zeros((batch,), jnp.int32),
               page_table=jnp.zeros((batch, max_pages), jnp.int32), absorb=absorb)

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return {name: ((1, self.num_pages, self.page_size, width), config.kv_dtype)
            for name, width in _widths(config).items()}

  def write(self, stored, latent, rope_key, span: Span):
    pages, slots = write_addresses(self.page_table, span, stored["latent"].shape[2])
    store = lambda pool, new: pool.at[0, pages, slots].set(new.astype(pool.dtype))  # new [B, T, width]
    return {"latent": store(stored["latent"], latent), "rope_key": store(stored["rope_key"], rope_key)}

  def read(self, stored, query, q_positions, span: Span, backend: Backend):
    latent, rope_key = (gather(stored[name], self.page_table)[:, 0] for name in ("latent", "rope_key"))
    return self.read_rows(query, q_positions, latent, rope_key)
