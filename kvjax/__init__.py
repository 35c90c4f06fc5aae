"""kvjax: KV-cache-efficient decoding for decoder-only transformers in JAX/Flax."""

from kvjax.serving.allocator import OutOfPages, PageAllocator
from kvjax.model.attention import Attention, attend, kv_head_of
from kvjax.config import ModelConfig, apply_overrides, from_dict, to_dict
from kvjax.conversion.kv_heads import convert_kv_heads
from kvjax.decoding.decode import cache_bytes, decode_step, generate, prefill
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.model.transformer import Transformer
from kvjax.cache.paged import PagedCache
from kvjax.training.config import DataConfig, TrainConfig, TrainRun
from kvjax.decoding.sampling import Sampling, sample

__version__ = "0.1.0"
