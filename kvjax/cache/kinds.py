"""The cache layouts by name (CacheConfig.layout): where the decode functions, the engine, the
memory budgets and the planner get a cache kind and its size. A new layout is one module whose
class (with `rows` and `bytes_for`, kvjax.cache.base) is registered by name
(kvjax.cache.config.register) and imported here."""

from __future__ import annotations

from kvjax.cache.base import KVCache
from kvjax.cache import kvzip  # noqa: F401  (its press registers)
from kvjax.cache.layouts import contiguous, evict, kivi, paged, paged_evict  # noqa: F401  (each registers its layout)
from kvjax.cache.config import LAYOUTS, CacheConfig
from kvjax.config import ModelConfig


def kind(cache_config: CacheConfig) -> type[KVCache]:
  return LAYOUTS[cache_config.layout]


def create(
  config: ModelConfig,
  cache_config: CacheConfig,
  batch: int,
  max_len: int,
  prompt: int | None = None,
  bucket: bool = False,
) -> KVCache:
  """An empty cache of `cache_config` for `batch` rows of max_len positions of a model of `config`;
  `prompt`, the length of the first call, sizes an evicting cache (kvjax.cache.layouts.evict). With
  `bucket`, its storage is rounded up to a bucket (kvjax.cache.base.size_bucket) and it holds
  max_len positions all the same (KVCache.limit): caches of one bucket share compiled functions."""
  return kind(cache_config).rows(config, batch, max_len, cache_config, prompt, bucket=bucket)


def cache_bytes(
  config: ModelConfig, cache_config: CacheConfig, batch: int, max_len: int, prompt: int | None = None
) -> int:
  """Bytes of create(config, cache_config, batch, max_len, prompt), from the config alone."""
  return kind(cache_config).bytes_for(config, cache_config, batch, max_len, prompt)


def sequence_bytes(config: ModelConfig, cache_config: CacheConfig, length: int) -> int:
  """Bytes the cache keeps for one sequence of `length` tokens (no bookkeeping)."""
  return kind(cache_config).sequence_bytes(config, cache_config, length)


def bytes_per_token(config: ModelConfig, cache_config: CacheConfig = CacheConfig()) -> int:
  """Bytes one token takes at every layer (no window counted): KVCache.position_bytes x layers."""
  return config.num_layers * KVCache.position_bytes(config, cache_config)
