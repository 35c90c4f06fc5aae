"""`kvjax bench quant`: one decode step's attention over an int8 cache against a float32 cache.

Every layer's contiguous cache (k [B, K, H, S], v [B, K, S, H]) is filled with random values
quantized by the int8 codec (kvjax.cache.codec: one absmax scale per position and
kv head, the storage the kernel reads, kvjax.kernels.attention); the float32 cache holds the
dequantized values (kvjax.cache.layouts.contiguous.dequantized), so both
compute the same attention and their outputs are compared. A timed step runs the one-token
attention of every layer in turn (each layer's output feeding the next one's query) through
kvjax.kernels.attention.cache_attention, the route a decode step takes; the two caches
alternate so that both see the same machine load. A decode step at this batch and context is
bound by reading the cache, so this is the part of it that int8 changes.

With `decode_step` (the default) it also times whole decode steps (kvjax.decode_step: every
layer, the MLPs and the logits) of the same model over a float32 and an int8 contiguous cache of
`context` positions per row, filled by each cache's own write (kvjax.bench.base.harness.filled_cache),
alternating the two so that both see the same machine load.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.base.harness import BENCH_MODEL, BenchConfig, alternate_decode_steps, filled_cache, init_model
from kvjax.cache.codec import codec
from kvjax.cache.config import CacheConfig
from kvjax.bench.base.registry import Benchmark, Option
from kvjax.cache.layouts.contiguous import attend_one
from kvjax.config import ModelConfig
from kvjax.kernels import attention as attention_kernel
from kvjax.timing import timed_alternating


def bench_quant(
  cfg: ModelConfig = BENCH_MODEL, *, batch: int = 32, context: int = 1024, repeats: int = 5, decode_step: bool = True
) -> dict:
  """Median ms of one step's attention over cfg.num_layers caches of `context` positions per row,
  int8 and float32 (the int8 values dequantized), in `repeats` alternating rounds; with
  `decode_step`, also of whole decode steps over a float32 and an int8 cache (`time_decode_steps`)."""
  if context < 1:
    raise ValueError(f"context={context} must be positive")
  b, kv, h, n = batch, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  keys = jax.random.split(jax.random.key(0), 2 * cfg.num_layers + 1)
  int8, float32 = [], []
  codecs = {"int8": codec("int8"), "float32": codec("float32")}
  for i in range(cfg.num_layers):
    (k, k_scale), (v, v_scale) = (
      codecs["int8"].encode(jax.random.normal(keys[2 * i + j], (b, kv, context, h))) for j in (0, 1)
    )  # [B, K, S, H], [B, K, S]
    k = k.swapaxes(2, 3)  # keys stored [B, K, H, S]
    int8.append((k, v, {"k_scale": k_scale, "v_scale": v_scale}))
    float32.append((codecs["int8"].decode(k, k_scale, axis=2), codecs["int8"].decode(v, v_scale), {}))
  q = jax.random.normal(keys[-1], (b, 1, n, h))
  lengths = jnp.full((b,), context - 1, jnp.int32)

  def step(name, layers):
    route, xla = ("contiguous", name), functools.partial(attend_one, codec=codecs[name])

    @jax.jit
    def run(q, layers):
      for k, v, addressing in layers:
        q = attention_kernel.cache_attention(route, q, k, v, lengths, xla, **addressing)
      return q

    return lambda: run(q, layers)

  calls = {"float32": step("float32", float32), "int8": step("int8", int8)}
  outputs = {name: np.asarray(call()) for name, call in calls.items()}
  times = timed_alternating(calls, repeats)
  ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
  cache_bytes = {
    name: sum(x.nbytes for layer in layers for x in jax.tree.leaves(layer))
    for name, layers in (("float32", float32), ("int8", int8))
  }
  result = {
    "benchmark": "quant",
    "backend": jax.default_backend(),
    "model": cfg.to_dict(),
    "batch": batch,
    "context": context,
    "repeats": repeats,
    "float32_kernel": attention_kernel.kernel_target(("contiguous", "float32"), q, *float32[0][:2], {}),
    "int8_kernel": attention_kernel.kernel_target(("contiguous", "int8"), q, int8[0][0], int8[0][1], int8[0][2]),
    "float32_cache_bytes": cache_bytes["float32"],
    "int8_cache_bytes": cache_bytes["int8"],
    "float32_step_ms": ms["float32"],
    "int8_step_ms": ms["int8"],
    "int8_speedup": ms["float32"] / ms["int8"],
    "int8_speedup_per_round": [f / i for f, i in zip(times["float32"], times["int8"])],
    "int8_GBps": cache_bytes["int8"] / ms["int8"] / 1e6,
    "float32_GBps": cache_bytes["float32"] / ms["float32"] / 1e6,
    "max_output_diff": float(np.abs(outputs["int8"] - outputs["float32"]).max()),
  }
  if decode_step:
    del int8, float32, calls
    result.update(time_decode_steps(cfg, batch, context, repeats))
  return result


def time_decode_steps(cfg: ModelConfig, batch: int, context: int, repeats: int) -> dict:
  """Median ms of one kvjax.decode_step of one model over a float32 and an int8 contiguous cache
  holding `context` positions per row, in `repeats` alternating rounds (each cache donated from
  step to step), and the first steps' largest logit difference."""
  model, params = init_model(cfg)
  models = {"float32": model, "int8": model}
  caches = {
    name: filled_cache(model, params, batch, context, context + repeats + 1, CacheConfig(dtype=name)) for name in models
  }
  times, logits = alternate_decode_steps({name: (m, params) for name, m in models.items()}, caches, batch, repeats)
  ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
  return {
    "float32_decode_step_ms": ms["float32"],
    "int8_decode_step_ms": ms["int8"],
    "int8_decode_speedup": ms["float32"] / ms["int8"],
    "int8_decode_speedup_per_round": [f / i for f, i in zip(times["float32"], times["int8"])],
    "decode_cache_bytes": {name: cache.nbytes for name, cache in caches.items()},
    "decode_first_step_max_logit_diff": float(np.abs(np.asarray(logits["int8"]) - np.asarray(logits["float32"])).max()),
  }


def run(config: BenchConfig, *, batch: int, context: int, repeats: int) -> dict:
  return bench_quant(config.model, batch=batch, context=context, repeats=repeats)


BENCHMARK = Benchmark(
  name="quant",
  summary="one decode step's attention, and whole decode steps, over an int8 cache vs a float32 cache",
  run=run,
  options=(
    Option("batch", 32, "sequences (rows) per step"),
    Option("context", 1024, "tokens cached per row"),
    Option("repeats", 5, "alternating timed rounds after a warm-up (median)"),
  ),
  config=BenchConfig(),
  description=__doc__,
)
