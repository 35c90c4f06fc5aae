"""kvjax: KV-cache-efficient decoding for decoder-only transformers in JAX/Flax."""

from kvjax.allocator import OutOfPages, PageAllocator
from kvjax.attention import Attention, attend, kv_head_of
from kvjax.config import ModelConfig, apply_overrides, from_dict, to_dict
from kvjax.convert import convert_kv_heads
from kvjax.decode import cache_bytes, decode_step, generate, prefill
from kvjax.engine import Engine, EngineConfig
from kvjax.model import Transformer
from kvjax.paged import PagedCache
from kvjax.run_config import DataConfig, TrainConfig, TrainRun
from kvjax.sampling import Sampling, sample

__version__ = "0.1.0"
