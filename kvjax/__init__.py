"""kvjax: KV-cache-efficient decoding for decoder-only transformers in JAX/Flax."""

from kvjax.cache.base import KVCache
from kvjax.cache.layouts.contiguous import ContiguousCache
from kvjax.cache.config import CacheConfig, cache_name
from kvjax.cache.kinds import create as create_cache
from kvjax.cache.layouts.paged import PagedCache
from kvjax.config import ModelConfig
from kvjax.fields import apply_overrides, from_dict, to_dict
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.conversion.kv_heads import convert_kv_heads
from kvjax.conversion.mla import convert_to_mla
from kvjax.decoding.decode import decode_step, extend, generate, prefill
from kvjax.decoding.many import answer_many, prefill_many
from kvjax.decoding.sampling import Sampling, sample
from kvjax.model.attention import Attention
from kvjax.model.keys import attend, kv_head_of
from kvjax.model.transformer import Transformer
from kvjax.serving.allocator import OutOfPages, PageAllocator
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.training.config import DataConfig, TrainConfig, TrainRun

__version__ = "0.1.0"
