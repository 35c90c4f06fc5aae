"""`kvjax bench decode`: generate tokens/s and the decode step of the benchmark model against this
machine's rooflines, measured in the same run: memory bandwidth (a jitted reduction over 1 GiB)
and matmul FLOP/s. The step reads a cache of `--set cache.FIELD=VALUE`'s kind
(kvjax.cache.config.CacheConfig: an int8 cache, a paged one, ...), counted with its scales.
"""

from __future__ import annotations

import dataclasses

from kvjax.bench.base.harness import (
  BENCH_MODEL,
  STEP_REPEATS,
  check_generation,
  decode_step_bytes,
  filled_cache,
  init_model,
  memory_bandwidth,
  prefill_flops,
  random_prompts,
  time_decode_step,
)
from kvjax.bench.base.registry import Benchmark, Option
from kvjax.cache.config import CacheConfig
from kvjax.config import ModelConfig
from kvjax.decoding import decode
from kvjax.decoding.step_timer import WARMUP
from kvjax.fields import to_dict
from kvjax.kernels import attention as attention_kernel
from kvjax.kernels import matmul
from kvjax.model.flops import peak_flops
from kvjax.timing import timed


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """What --set changes in `kvjax bench decode`: the benchmark model (model.FIELD) and its cache
  (cache.FIELD, kvjax.cache.config.CacheConfig)."""

  model: ModelConfig = BENCH_MODEL
  cache: CacheConfig = CacheConfig()


def bench_decode(
  cfg: ModelConfig = BENCH_MODEL,
  *,
  batch: int = 8,
  prompt: int = 128,
  new_tokens: int = 128,
  repeats: int = 5,
  cache_config: CacheConfig = CacheConfig(),
) -> dict:
  """Decode step (ms) on a cache of `cache_config` of `prompt` positions per row and, for
  new_tokens > 1, generate tokens/s from prompts of `prompt` tokens, each against its roofline;
  generate is timed as the median of `repeats` runs."""
  model, params = init_model(cfg)
  bandwidth, flops = memory_bandwidth(), peak_flops()[0]
  result = {
    "benchmark": "decode",
    "model": cfg.to_dict(),
    "batch": batch,
    "prompt": prompt,
    "new_tokens": new_tokens,
    "small_matmul_kernel": matmul.uses_kernel(batch, cfg.compute_dtype),
    "cache": to_dict(cache_config),
    "memory_bandwidth_GBps": bandwidth / 1e9,
    "matmul_GFLOPs": flops / 1e9,
  }

  cache = filled_cache(model, params, batch, prompt, prompt + STEP_REPEATS + WARMUP, cache_config)
  result["decode_attention_kernel"] = attention_kernel.uses_kernel(cfg.compute_dtype, cache.route)
  step = time_decode_step(model, params, cache)
  step_bytes = decode_step_bytes(cfg, batch, prompt, cache_config)
  result.update(
    decode_step_ms=step * 1e3,
    decode_step_bytes=step_bytes,
    decode_step_roofline_ms=step_bytes / bandwidth * 1e3,
    decode_roofline_fraction=step_bytes / bandwidth / step,
  )

  if new_tokens > 1:
    prompts, lengths = random_prompts(cfg, batch, prompt)
    seconds = timed(
      lambda: decode.generate(model, params, prompts, lengths, new_tokens, cache_config=cache_config), repeats
    )
    ceiling = prefill_flops(cfg, batch, prompt) / flops + sum(
      decode_step_bytes(cfg, batch, prompt + i, cache_config) / bandwidth for i in range(new_tokens - 1)
    )
    tokens = batch * new_tokens
    result.update(
      generate_s=seconds,
      tokens_per_s=tokens / seconds,
      ceiling_tokens_per_s=tokens / ceiling,
      fraction_of_ceiling=ceiling / seconds,
    )
  return result


def run(config: DecodeConfig, *, batch: int, prompt: int, new: int, repeats: int) -> dict:
  check_generation(config.model, prompt, new)
  return bench_decode(
    config.model, batch=batch, prompt=prompt, new_tokens=new, repeats=repeats, cache_config=config.cache
  )


BENCHMARK = Benchmark(
  name="decode",
  summary="generate tokens/s and the decode step against this machine's rooflines",
  run=run,
  options=(
    Option("batch", 8, "sequences (rows) per step"),
    Option("prompt", 128, "prompt tokens per sequence"),
    Option("new", 128, "new tokens per sequence (1: the decode step only)"),
    Option("repeats", 5, "timed generate runs after a warm-up (median)"),
  ),
  config=DecodeConfig(),
  description=__doc__,
)
