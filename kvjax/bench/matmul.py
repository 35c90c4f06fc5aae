"""`kvjax bench matmul`: kvjax's CPU small-matmul kernel (kvjax.kernels.matmul) against XLA's dot
on the weight shapes of the benchmark model's decode step, at the row counts where the kernel is
chosen and around them, in alternating rounds.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.base.harness import BENCH_MODEL, BenchConfig
from kvjax.bench.base.registry import Benchmark, Option
from kvjax.config import ModelConfig
from kvjax.kernels import matmul
from kvjax.timing import timed_alternating


def bench_matmul(cfg: ModelConfig = BENCH_MODEL, *, batch: int = 8, repeats: int = 5) -> dict:
  """Per-call time of x[rows, K] @ w[K, N] for each weight shape of a decode step and rows in
  (1, matmul.MIN_ROWS, batch, matmul.MAX_ROWS), by XLA's dot and by the kernel, in `repeats`
  alternating rounds. Each timed call chains 16 products over distinct weights
  (the weights stream from memory, as in a decode step)."""
  if not matmul.kernel_available():
    raise ValueError("the CPU small-matmul kernel is unavailable here (see kvjax.kernels.matmul)")
  d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  mlp_in = "gate, up" if cfg.activation in ("swiglu", "geglu") else "up"
  shapes = {"q": (d, q), "k, v": (d, kv), "out": (q, d), mlp_in: (d, cfg.mlp_dim), "down": (cfg.mlp_dim, d)}
  if not cfg.tie_embeddings:  # tied logits go through the embedding's attend, not a Dense layer
    shapes["lm_head"] = (d, cfg.vocab_size)
  chain = 16
  rng = np.random.default_rng(0)

  def chained(product, x, weights):
    def run(x, weights):
      for w in weights:  # each product feeds the next, so the calls cannot overlap
        x = x + 1e-3 * jnp.resize(product(x, w), x.shape)
      return x

    run = jax.jit(run)
    return lambda: run(x, weights)

  rows_list = sorted({1, matmul.MIN_ROWS, batch, matmul.MAX_ROWS})
  calls = {}
  for name, (k, n) in shapes.items():
    weights = [jnp.asarray(rng.standard_normal((k, n), np.float32)) for _ in range(chain)]
    for rows in rows_list:
      x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
      calls[name, rows, "xla"] = chained(jnp.matmul, x, weights)
      calls[name, rows, "kernel"] = chained(matmul.small_matmul, x, weights)
  times = timed_alternating(calls, repeats)
  results = []
  for name, (k, n) in shapes.items():
    for rows in rows_list:
      xla, kernel = (statistics.median(times[name, rows, side]) / chain for side in ("xla", "kernel"))
      results.append(
        {
          "weight": name,
          "rows": rows,
          "k": k,
          "n": n,
          "xla_us": xla * 1e6,
          "kernel_us": kernel * 1e6,
          "xla_over_kernel": xla / kernel,
          "kernel_weight_GBps": k * n * 4 / kernel / 1e9,
        }
      )
  return {"benchmark": "matmul", "model": cfg.to_dict(), "max_rows": matmul.MAX_ROWS, "results": results}


def run(config: BenchConfig, *, batch: int, repeats: int) -> dict:
  return bench_matmul(config.model, batch=batch, repeats=repeats)


BENCHMARK = Benchmark(
  name="matmul",
  summary="kvjax's CPU small-matmul kernel vs XLA's dot on the decode step's weight shapes",
  run=run,
  options=(
    Option("batch", 8, "rows timed besides 1 and the kernel's bounds"),
    Option("repeats", 5, "alternating timed rounds after a warm-up (median)"),
  ),
  config=BenchConfig(),
  description=__doc__,
)
