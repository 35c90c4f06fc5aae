"""`kvjax bench evict`: a decode step over a full cache and over evicted caches (kvjax.cache.layouts.evict)
of a pretrained model at a long context, in one run.

Each cache holds `context` positions per row, written at random (no prefill: the time of a step
does not depend on which tokens a press kept); an evicted one holds int(context * (1 - ratio))
of them. Reported per cache: the decode step (ms, median over rounds that step every cache once),
the attention of one step alone (all layers' decode reads, through the same kernel route), and
the bytes that attention reads, each with its ratio to the full cache's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.peers.hf_model import check_source
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Option
from kvjax.cache.layouts.fill import filled, filled_evicted
from kvjax.cache import kinds
from kvjax.cache.codec import codec
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.contiguous import attend_one
from kvjax.cache.selection import kept
from kvjax.cache.presses import make_press
from kvjax.decoding import decode
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer, cache_layers
from kvjax.model.weights import store
from kvjax.timing import timed_alternating

RATIOS = (0.5, 0.75, 0.875)


@functools.partial(jax.jit, static_argnames=("backend",))
def _attention(backend, q, stored: list, filled_through: list):
  """Every layer's decode read of a float32 cache: q [B, 1, N, H] against each layer's k/v
  through the contiguous decode route, positions [0, filled_through[layer][b]]."""
  read = functools.partial(attend_one, codec=codec("float32"))
  return [
    backend.cache_attention(("contiguous", "float32"), q, s["k"], s["v"], through, read)
    for s, through in zip(stored, filled_through)
  ]


def bench_evict(
  source: str = "smollm2-135m",
  *,
  batch: int = 8,
  context: int = 2048,
  ratios=RATIOS,
  press: str = "snapkv",
  weights: str = "int8",
  steps: int = 8,
  repeats: int = 5,
) -> dict:
  """The decode step and its attention over a full cache and over caches evicted at `ratios`."""
  params, config, _, path = read_model(source)
  model = Transformer(config)
  params = store(params, weights)
  max_len = context + (steps + 2) * (repeats + 2)
  caches = {"full": filled(kinds.create(config, CacheConfig(), batch, max_len), config, context)}
  for ratio in ratios:
    cache_config = CacheConfig(press=make_press(press, compression_ratio=ratio))
    caches[f"ratio_{ratio}"] = filled_evicted(config, cache_config, batch, context, max_len)
  tokens = np.zeros((batch,), np.int32)

  def step(name):
    def run():
      logits, caches[name] = decode.decode_step(model, params, caches[name], tokens)
      return logits

    return run

  step_s = timed_alternating({name: step(name) for name in caches}, repeats)
  backend = decode.cpu_backend()
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(batch, 1, config.num_heads, config.head_dim)), jnp.float32)
  reads, read_bytes = {}, {}
  for name, cache in caches.items():
    stored = [{n: layer[n] for n in ("k", "v")} for layer in cache_layers(cache.layers)]
    held = context if name == "full" else int(kept(context, cache.press.compression_ratio))
    # A windowed layer (a ring, never pressed) reads its window and sinks whatever the ratio.
    reads_of = [min(held, layer["v"].shape[2]) for layer in stored]
    through = [jnp.full((batch,), n - 1, jnp.int32) for n in reads_of]
    reads[name] = functools.partial(_attention, backend, q, stored, through)
    read_bytes[name] = sum(reads_of) * batch * 2 * config.num_kv_heads * config.head_dim * 4
  attention_s = timed_alternating(reads, repeats)
  median = lambda xs: float(np.median(xs))
  step_ms = {n: 1e3 * median(s) for n, s in step_s.items()}
  attention_ms = {n: 1e3 * median(s) for n, s in attention_s.items()}
  return {
    "benchmark": "evict",
    "source": str(path),
    "batch": batch,
    "context": context,
    "press": press,
    "weights": weights,
    "step_ms": step_ms,
    "attention_ms": attention_ms,
    "attention_bytes": read_bytes,
    "step_speedup": {n: step_ms["full"] / v for n, v in step_ms.items()},
    "attention_speedup": {n: attention_ms["full"] / v for n, v in attention_ms.items()},
    "attention_bytes_fraction": {n: v / read_bytes["full"] for n, v in read_bytes.items()},
    "cache_bytes": {n: int(c.nbytes) for n, c in caches.items()},
  }


def run(*, model: str, batch: int, context: int, repeats: int) -> dict:
  check_source(model)
  return bench_evict(model, batch=batch, context=context, repeats=repeats)


BENCHMARK = Benchmark(
  name="evict",
  summary="a pretrained model's decode step over a full cache vs evicted caches",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("batch", 8, "sequences (rows) per step"),
    Option("context", 1024, "tokens cached per row before eviction"),
    Option("repeats", 5, "alternating timed rounds after a warm-up (median)"),
  ),
  description=__doc__,
)
