"""The cache layouts: where a write goes and how a read finds it (kvjax.cache.base.KVCache), each
registered by name (CacheConfig.layout, kvjax.cache.kinds), and the caches built over them.

  contiguous    every row preallocates its positions (windowed layers: a ring)
  paged         page pools addressed through page tables (PagedAttention)
  evict         a press's kept tokens in a fixed number of slots per row and kv head
  paged_evict   the evicting layout's slots in pages (the engine's pressed cache)
  kivi          KIVI's quantized groups beside a float residual
  fanout        one prefill handing each layer's prompt to several caches
  stack         the rows of many evicting caches as one, decoded in one batch
  fill          caches holding random payloads, for timing a step
"""
