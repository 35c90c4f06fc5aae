"""Which cache kind holds a model: the decode functions and the engine build their caches here,
so an MLA model (ModelConfig.kv_latent_rank > 0) gets a latent cache and every other model K/V."""

from __future__ import annotations

from kvjax.cache.contiguous import ContiguousCache
from kvjax.cache.latent import LatentCache, PagedLatentCache
from kvjax.cache.paged import PagedCache
from kvjax.config import ModelConfig


def contiguous(config: ModelConfig) -> type:
  """The contiguous kind for a model of `config`: LatentCache for MLA, else ContiguousCache."""
  return LatentCache if config.is_latent else ContiguousCache


def paged(config: ModelConfig) -> type:
  """The paged kind for a model of `config`: PagedLatentCache for MLA, else PagedCache."""
  return PagedLatentCache if config.is_latent else PagedCache
