"""`kvjax bench paged`: the paged decode step against the contiguous one at equal batch and context.

Both caches hold the same K/V (the same random rows, written over randomly ordered pages),
so the first step's logits are compared too. Steps alternate between the caches so that both see
the same machine load.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.base.harness import BENCH_MODEL, BenchConfig, alternate_decode_steps, filled_cache, init_model
from kvjax.cache.layouts.fill import filled
from kvjax.cache.config import CacheConfig
from kvjax.bench.base.registry import Benchmark, Option
from kvjax.cache.layouts.paged import PagedCache, pallas_available
from kvjax.config import ModelConfig
from kvjax.kernels import attention as attention_kernel


def bench_paged(
  cfg: ModelConfig = BENCH_MODEL, *, batch: int = 8, repeats: int = 5, context: int = 1024, page_size: int = 16
) -> dict:
  """Median step times of the contiguous and paged caches (and the Pallas kernel's, on a GPU),
  each holding `context - steps` tokens per row when timing starts."""
  impls = ["gather", "pallas"] if pallas_available() else ["gather"]
  steps = max(4 * repeats, 8)
  advance = steps + 1  # each cache takes one warm-up step and `steps` timed ones
  if context % page_size or context > cfg.max_len or context <= advance:
    raise ValueError(
      f"context={context} must be a multiple of page_size={page_size}, at most "
      f"ModelConfig.max_len={cfg.max_len} and more than {advance} (the timed steps)"
    )
  model, params = init_model(cfg)
  start = context - advance
  contiguous = filled_cache(model, params, batch, start, context)
  width = context // page_size
  table = np.random.default_rng(0).permutation(np.arange(1, batch * width + 1)).reshape(batch, width)

  caches = {"contiguous": contiguous}
  for impl in impls:
    empty = PagedCache.create(
      cfg, batch * width + 1, page_size, batch, width, CacheConfig(layout="paged", paged_read=impl)
    )
    caches[impl] = filled(empty.with_rows(table, np.zeros(batch, np.int32)), cfg, start)  # the same random K/V
  times, first = alternate_decode_steps({name: (model, params) for name in caches}, caches, batch, steps)
  ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
  result = {
    "benchmark": "paged",
    "backend": jax.default_backend(),
    "model": cfg.to_dict(),
    "batch": batch,
    "context": context,
    "page_size": page_size,
    "steps": steps,
    "decode_attention_kernel": attention_kernel.uses_kernel(cfg.compute_dtype, caches["gather"].route),
    "contiguous_step_ms": ms["contiguous"],
    "paged_step_ms": ms["gather"],
    "paged_over_contiguous": ms["gather"] / ms["contiguous"],
    "paged_over_contiguous_per_round": [p / c for p, c in zip(times["gather"], times["contiguous"])],
    "first_step_max_logit_diff": float(jnp.abs(first["gather"] - first["contiguous"]).max()),
    "pallas_available": pallas_available(),
  }
  if "pallas" in caches:
    result.update(
      pallas_step_ms=ms["pallas"],
      pallas_over_contiguous=ms["pallas"] / ms["contiguous"],
      pallas_first_step_max_logit_diff=float(jnp.abs(first["pallas"] - first["contiguous"]).max()),
    )
  return result


def run(config: BenchConfig, *, batch: int, context: int, page_size: int, repeats: int) -> dict:
  return bench_paged(config.model, batch=batch, context=context, page_size=page_size, repeats=repeats)


BENCHMARK = Benchmark(
  name="paged",
  summary="paged vs contiguous decode step at equal batch and context",
  run=run,
  options=(
    Option("batch", 8, "sequences (rows) per step"),
    Option("context", 1024, "tokens cached per row"),
    Option("page_size", 16, "tokens per page"),
    Option("repeats", 5, "the timed steps per cache are max(4 x repeats, 8); median"),
  ),
  config=BenchConfig(),
  description=__doc__,
)
