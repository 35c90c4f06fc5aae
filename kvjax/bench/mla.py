"""`kvjax bench mla`: the absorbed MLA decode step against the GQA step with the same KV bytes per
token, at equal batch and context.

The MLA model is the benchmark model with kv_latent_rank + rope_dims = 2 x num_kv_heads x head_dim
(its num_kv_heads groups of rotary dims, as a conversion of that GQA model keeps them), so both
caches hold the same bytes per token and a decode step reads the same bytes of cache. Each cache
holds random contents; steps alternate between the models so that they see the same machine load.
The MLA cache read expanded (per-head K/V formed from the latents every step) is timed beside them;
it holds the same latents as the absorbed one, so their first steps' logits are compared too.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np

from kvjax.bench.base.harness import BENCH_MODEL, BenchConfig, alternate_decode_steps, init_model
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.bench.base.registry import Benchmark, Kind, Option
from kvjax.config import ModelConfig


def filled(model, batch: int, held: int, max_len: int, absorb: bool = True):
  """A contiguous cache of the model with `held` random positions in each row."""
  cache = kinds.create(model.config, CacheConfig(absorb=absorb), batch, max_len)
  leaves, tree = jax.tree.flatten(cache.layers)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  layers = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
  return cache.replace(layers=layers, lengths=np.full((batch,), held, np.int32))


def bench_mla(
  cfg: ModelConfig = BENCH_MODEL,
  *,
  batch: int = 32,
  repeats: int = 5,
  context: int = 1024,
  rope_dims: int | None = None,
  expanded: bool = True,
) -> dict:
  """Median step times of the GQA model `cfg` and of its MLA form of equal KV bytes per token
  (rope_dims defaults to 16 per kv head), each cache holding `context - steps` tokens per row when
  timing starts; with `expanded` also the MLA cache read without absorption."""
  rope_dims = 16 * cfg.num_kv_heads if rope_dims is None else rope_dims
  mla = cfg.replace(kv_latent_rank=2 * cfg.num_kv_heads * cfg.head_dim - rope_dims, rope_dims=rope_dims)
  steps = max(4 * repeats, 8)
  if context > cfg.max_len or context <= steps + 1:
    raise ValueError(
      f"context={context} must be at most ModelConfig.max_len={cfg.max_len} and more than {steps + 1} (the timed steps)"
    )
  held = context - steps - 1
  models = {"gqa": init_model(cfg), "mla": init_model(mla)}
  caches = {
    "gqa": filled(models["gqa"][0], batch, held, context),
    "mla": filled(models["mla"][0], batch, held, context),
  }
  if expanded:
    models["mla_expanded"] = models["mla"]
    caches["mla_expanded"] = filled(models["mla"][0], batch, held, context, absorb=False)
  times, first = alternate_decode_steps(models, caches, batch, steps)
  ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
  result = {
    "benchmark": "mla",
    "backend": jax.default_backend(),
    "gqa_model": cfg.to_dict(),
    "mla_model": mla.to_dict(),
    "batch": batch,
    "context": context,
    "steps": steps,
    "kv_bytes_per_token": {"gqa": kinds.bytes_per_token(cfg), "mla": kinds.bytes_per_token(mla)},
    "gqa_step_ms": ms["gqa"],
    "mla_step_ms": ms["mla"],
    "mla_over_gqa": ms["mla"] / ms["gqa"],
    "mla_over_gqa_per_round": [m / g for m, g in zip(times["mla"], times["gqa"])],
  }
  if expanded:
    result.update(
      mla_expanded_step_ms=ms["mla_expanded"],
      expanded_over_absorbed=ms["mla_expanded"] / ms["mla"],
      first_step_max_logit_diff=float(np.abs(first["mla_expanded"] - first["mla"]).max()),
    )
  return result


def run(config: BenchConfig, *, batch: int, context: int, rope_dims: int | None, repeats: int) -> dict:
  return bench_mla(config.model, batch=batch, context=context, rope_dims=rope_dims, repeats=repeats)


BENCHMARK = Benchmark(
  name="mla",
  summary="the absorbed MLA decode step vs the GQA step of equal KV bytes per token",
  run=run,
  options=(
    Option("batch", 32, "sequences (rows) per step"),
    Option("context", 1024, "tokens cached per row"),
    Option("rope_dims", None, "rotary dims of the MLA model (default: 16 per kv head)", Kind.NONNEGATIVE),
    Option("repeats", 5, "the timed steps per model are max(4 x repeats, 8); median"),
  ),
  config=BenchConfig(),
  description=__doc__,
)
