"""`kvjax bench products`: the prefill's products, kvjax against torch (oneDNN), format for format,
in GFLOP/s per shape.

On a model's shapes (default SmolLM2-135M's, kvjax.bench.base.harness.SMOLLM2_SHAPES), `--rows` tokens at
a time: each weight's product (q, k and v, out, gate and up, down) as kvjax computes it with weights
stored in the format (kvjax.numerics.matmul: float32 in float32; bfloat16 weights against the
activations rounded to bfloat16, accumulated in float32) beside torch's `x @ w` with both in that
format; and one layer's causal attention over `--prompt` tokens per row, `--batch` rows (kvjax's
prefill route, kvjax.model.backend.Backend.prompt_attention, float32 whatever the weights) beside
torch's scaled_dot_product_attention in the format (is_causal, grouped heads). The two sides are
timed in alternated rounds; each figure is the median's GFLOP/s (attention: the causal half's
flops, 4 T^2 H N / 2 per row) and `over_torch` is kvjax's rate over torch's.

torch's OpenMP threads spin for a while after each parallel region, on the cores the next call
(kvjax's) needs: alternating calls of a few milliseconds, kvjax's float32 products measured
0.80-0.96x torch's that way and 0.94-1.12x with torch told to wait passively (its own rates did
not change). So, where torch is not imported yet, this benchmark sets OMP_WAIT_POLICY=PASSIVE.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.base.registry import Benchmark, Kind, Option
from kvjax.bench.base.harness import SMOLLM2_SHAPES
from kvjax.bench.peers.hf_model import import_torch
from kvjax.config import ModelConfig
from kvjax.decoding.decode import cpu_backend
from kvjax.model.keys import Visibility, attend_keys
from kvjax.numerics import matmul
from kvjax.timing import timed_alternating

FORMATS = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ProductsConfig:
  """What --set changes in `kvjax bench products`: the model's shapes (model.FIELD)."""

  model: ModelConfig = SMOLLM2_SHAPES


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """{name: (K, N)} of one layer's products."""
  d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  gated = cfg.activation in ("swiglu", "geglu")
  return {
    "q": (d, q),
    "k, v": (d, kv),
    "out": (q, d),
    "gate, up" if gated else "up": (d, cfg.mlp_dim),
    "down": (cfg.mlp_dim, d),
  }


def bench_products(
  cfg: ModelConfig = SMOLLM2_SHAPES,
  *,
  rows: int = 4096,
  batch: int = 8,
  prompt: int = 2048,
  formats=FORMATS,
  repeats: int = 3,
) -> dict:
  """GFLOP/s of kvjax's and torch's products and prefill attention (module docstring)."""
  if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  torch, _ = import_torch()
  rng = np.random.default_rng(0)
  calls, flops = {}, {}
  for fmt in formats:
    for name, (k, n) in weight_shapes(cfg).items():
      x = rng.standard_normal((rows, k)).astype(np.float32)
      w = rng.standard_normal((k, n)).astype(np.float32)
      xj, wj = jnp.asarray(x), jnp.asarray(w, fmt)
      ours = jax.jit(matmul)
      xt, wt = (torch.from_numpy(a).to(getattr(torch, fmt)) for a in (x, w))
      calls[fmt, name, "kvjax"] = lambda ours=ours, xj=xj, wj=wj: ours(xj, wj)
      calls[fmt, name, "torch"] = lambda xt=xt, wt=wt: _torch(torch, lambda: xt @ wt)
      flops[fmt, name] = 2 * rows * k * n
  h, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  q = rng.standard_normal((batch, prompt, heads, h)).astype(np.float32)
  k, v = (rng.standard_normal((batch, kv_heads, prompt, h)).astype(np.float32) for _ in range(2))
  positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (batch, prompt))
  keys = Visibility(positions, positions)
  attend = jax.jit(lambda q, k, v: cpu_backend().prompt_attention(q, k, v, keys, attend_keys))
  qj, kj, vj = map(jnp.asarray, (q, k, v))
  for fmt in formats:  # kvjax's prefill attends in float32 whatever its weights' format
    calls[fmt, "attention", "kvjax"] = lambda: attend(qj, kj, vj)
    qt, kt, vt = (torch.from_numpy(a).to(getattr(torch, fmt)) for a in (q.swapaxes(1, 2), k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls[fmt, "attention", "torch"] = lambda qt=qt, kt=kt, vt=vt: _torch(
      torch, lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True)
    )
    flops[fmt, "attention"] = 4 * batch * heads * prompt * prompt * h // 2
  times = timed_alternating(calls, repeats)
  results = []
  for (fmt, name), count in flops.items():
    rate = {side: count / statistics.median(times[fmt, name, side]) / 1e9 for side in ("kvjax", "torch")}
    results.append(
      {
        "format": fmt,
        "product": name,
        "gflop": count / 1e9,
        "kvjax_GFLOPs": rate["kvjax"],
        "torch_GFLOPs": rate["torch"],
        "over_torch": rate["kvjax"] / rate["torch"],
      }
    )
  return {
    "benchmark": "products",
    "model": cfg.to_dict(),
    "rows": rows,
    "batch": batch,
    "prompt": prompt,
    "repeats": repeats,
    "torch_threads": torch.get_num_threads(),
    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    "results": results,
  }


def _torch(torch, fn):
  with torch.inference_mode():
    return fn()


def run(config: ProductsConfig, *, rows: int, batch: int, prompt: int, formats: list, repeats: int) -> dict:
  return bench_products(config.model, rows=rows, batch=batch, prompt=prompt, formats=tuple(formats), repeats=repeats)


BENCHMARK = Benchmark(
  name="products",
  summary="the prefill's products and attention, kvjax against torch (oneDNN) in GFLOP/s, format for format",
  run=run,
  options=(
    Option("rows", 4096, "tokens per weight product"),
    Option("batch", 8, "rows of the attention"),
    Option("prompt", 2048, "tokens per row of the attention"),
    Option("formats", list(FORMATS), "weight formats, each side in the same", Kind.NAMES, FORMATS),
    Option("repeats", 3, "alternating timed rounds after a warm-up (median)"),
  ),
  config=ProductsConfig(),
  description=__doc__,
)
