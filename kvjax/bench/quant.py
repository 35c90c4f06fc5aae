"""`kvjax bench quant`: one decode step's attention over an int8 cache against a float32 cache.

Every layer's contiguous cache (k [B, K, H, S], v [B, K, S, H]) is filled with random values and
quantized by hand (symmetric, one absmax scale per position and kv head: the storage of an int8
cache kind, kvjax.kernels.attention); the float32 cache holds the dequantized values, so both
compute the same attention and their outputs are compared. A timed step runs the one-token
attention of every layer in turn (each layer's output feeding the next one's query) through
kvjax.kernels.attention.cache_attention, the route a decode step takes; the two caches
alternate so that both see the same machine load. A decode step at this batch and context is
bound by reading the cache, so this is the part of it that int8 changes.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.benchmarks import BENCH_MODEL
from kvjax.cache.contiguous import attend_one
from kvjax.config import ModelConfig
from kvjax.kernels import attention as attention_kernel
from kvjax.timing import timed_alternating


def quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 along `axis` (the head axis): x ~ q * scale, scale = absmax / 127 per slice."""
  scale = jnp.max(jnp.abs(x), axis=axis) / 127
  q = jnp.round(x / jnp.expand_dims(jnp.where(scale > 0, scale, 1), axis))
  return q.astype(jnp.int8), scale


def attend_int8(q, k, v, lengths, k_scale, v_scale):
  """XLA on the dequantized cache: k [B, K, H, S] * k_scale [B, K, S], v [B, K, S, H] * v_scale."""
  return attend_one(q, k * k_scale[:, :, None, :], v * v_scale[..., None], lengths)


def bench_quant(cfg: ModelConfig = BENCH_MODEL, *, batch: int = 32, context: int = 1024, repeats: int = 5) -> dict:
  """Median ms of one step's attention over cfg.num_layers caches of `context` positions per row,
  int8 and float32 (the int8 values dequantized), in `repeats` alternating rounds."""
  if context < 1:
    raise ValueError(f"context={context} must be positive")
  b, kv, h, n = batch, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  keys = jax.random.split(jax.random.key(0), 2 * cfg.num_layers + 1)
  int8, float32 = [], []
  for i in range(cfg.num_layers):
    k, k_scale = quantize(jax.random.normal(keys[2 * i], (b, kv, h, context)), axis=2)
    v, v_scale = quantize(jax.random.normal(keys[2 * i + 1], (b, kv, context, h)), axis=3)
    int8.append((k, v, {"k_scale": k_scale, "v_scale": v_scale}))
    float32.append((k * k_scale[:, :, None, :], v * v_scale[..., None], {}))
  q = jax.random.normal(keys[-1], (b, 1, n, h))
  lengths = jnp.full((b,), context - 1, jnp.int32)

  def step(layers, xla):
    @jax.jit
    def run(q, layers):
      for k, v, addressing in layers:
        q = attention_kernel.cache_attention(q, k, v, lengths, xla, **addressing)
      return q
    return lambda: run(q, layers)

  calls = {"float32": step(float32, attend_one), "int8": step(int8, attend_int8)}
  outputs = {name: np.asarray(call()) for name, call in calls.items()}
  times = timed_alternating(calls, repeats)
  ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
  cache_bytes = {name: sum(x.nbytes for layer in layers for x in jax.tree.leaves(layer))
                 for name, layers in (("float32", float32), ("int8", int8))}
  return {"benchmark": "quant", "backend": jax.default_backend(), "model": cfg.to_dict(), "batch": batch,
          "context": context, "repeats": repeats,
          "float32_kernel": attention_kernel.kernel_target(q, *float32[0][:2], {}),
          "int8_kernel": attention_kernel.kernel_target(q, int8[0][0], int8[0][1], int8[0][2]),
          "float32_cache_bytes": cache_bytes["float32"], "int8_cache_bytes": cache_bytes["int8"],
          "float32_step_ms": ms["float32"], "int8_step_ms": ms["int8"],
          "int8_speedup": ms["float32"] / ms["int8"],
          "int8_speedup_per_round": [f / i for f, i in zip(times["float32"], times["int8"])],
          "int8_GBps": cache_bytes["int8"] / ms["int8"] / 1e6, "float32_GBps": cache_bytes["float32"] / ms["float32"] / 1e6,
          "max_output_diff": float(np.abs(outputs["int8"] - outputs["float32"]).max())}
