"""`kvjax bench codecs`: the decode step over each cache codec against the float32 cache, beside
the bytes each holds.

One model (SmolLM2-135M's shapes, random weights stored as `--weights`) decodes a contiguous
cache of each codec (kvjax.cache.codec) whose rows hold `--context` random positions, one step
per cache per round, the rounds alternated so that every cache sees the same machine load
(kvjax.bench.base.harness.alternate_decode_steps). The attention alone is timed too: every
layer's one-token attention over the same caches' arrays in turn (each layer's output the next
one's query), through the route a decode step takes (kvjax.kernels.attention.cache_attention),
also alternated. Reading the cache bounds that attention, so it should follow the codec's bytes.
Two targets per codec: the attention within TARGET_SLACK (1.3)x of (its bytes / float32's bytes)
x float32's attention, and the whole step never slower than float32's (the weights and the MLPs
do not shrink with the cache). Reported per codec: bytes per position (every layer, scales
included), that ratio, the step's and the attention's medians and their ratios to float32's (the
median of the per-round ratios), the targets and whether each is met; and the step's ratio
beside the bytes the whole step reads (the weights as stored, plus the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp

from kvjax.bench.base.harness import SMOLLM2_SHAPES, alternate_decode_steps, filled_cache, init_model
from kvjax.bench.base.registry import Benchmark, Kind, Option
from kvjax.cache import kinds
from kvjax.cache.codec import KIVI, NAMES
from kvjax.cache.base import KVCache
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.contiguous import attend_one
from kvjax.config import ModelConfig
from kvjax.decoding import decode
from kvjax.kernels import attention as attention_kernel
from kvjax.model.attention import KVQuery, Span
from kvjax.model.transformer import cache_layers
from kvjax.model.weights import FORMATS, store
from kvjax.timing import timed_alternating

TARGET_SLACK = 1.3  # a codec's attention may take this much more than its bytes' share of float32's
# The caches by name: each codec, the quantized ones also rotated (kvjax.cache.rotation), KIVI's.
VARIANTS = {
  **{name: CacheConfig(dtype=name) for name in NAMES},
  **{f"{name}+hadamard": CacheConfig(dtype=name, rotation="hadamard") for name in ("int8", "int4")},
  **{name: CacheConfig(dtype=name) for name in KIVI},
}


def attention_call(cache: KVCache, q: jax.Array, lengths: jax.Array):
  """A call of every layer's one-token attention over a contiguous K/V cache's arrays in turn,
  q [B, 1, N, H] the first layer's query, each output the next layer's query. KIVI's layout reads
  through its decode route (its kernel at 4 bits, XLA at 2)."""
  if cache.layout == "kivi":
    span = Span(positions=lengths[:, None], lengths=jnp.ones_like(lengths))

    @jax.jit
    def read(q, layers):
      for layer in layers:
        q = cache.decode_read(layer, KVQuery(q), span, decode.cpu_backend())
      return q

    stored = cache_layers(cache.layers)
    return lambda: read(q, stored)
  xla = functools.partial(attend_one, codec=cache.codec)
  layers = [(layer["k"], layer["v"], cache.scales(layer)) for layer in cache_layers(cache.layers)]

  @jax.jit
  def run(q, layers):
    for k, v, scales in layers:
      q = attention_kernel.cache_attention(cache.route, q, k, v, lengths, xla, **scales)
    return q

  return lambda: run(q, layers)


@dataclasses.dataclass(frozen=True)
class CodecsConfig:
  """What --set changes in `kvjax bench codecs`: the model (model.FIELD)."""

  model: ModelConfig = SMOLLM2_SHAPES


def bench_codecs(
  cfg: ModelConfig = SMOLLM2_SHAPES,
  *,
  codecs: tuple[str, ...] = ("bfloat16", "float16", "int8", "float8_e4m3fn", "int4"),
  batch: int = 8,
  context: int = 2048,
  repeats: int = 5,
  weights: str = "int8",
) -> dict:
  """Decode steps over a float32 cache and each of `codecs`' caches of `context` positions per
  row, `repeats` alternated rounds (module docstring)."""
  cfg.check_length(context + repeats + 2, f"--context {context} and {repeats} rounds")
  model, params = init_model(cfg)
  params = store(params, weights)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  names = ("float32", *(c for c in codecs if c != "float32"))
  caches = {name: filled_cache(model, params, batch, context, context + repeats + 2, VARIANTS[name]) for name in names}
  times, _ = alternate_decode_steps({name: (model, params) for name in names}, caches, batch, repeats)
  q = jax.random.normal(jax.random.key(1), (batch, 1, cfg.num_heads, cfg.head_dim))
  lengths = jnp.full((batch,), context - 1, jnp.int32)
  attention = timed_alternating({name: attention_call(caches[name], q, lengths) for name in names}, repeats)
  position_bytes = {name: kinds.bytes_per_token(cfg, VARIANTS[name]) for name in names}
  step_bytes = {name: weight_bytes + batch * context * position_bytes[name] for name in names}
  rows = {}
  for name in names:
    bytes_ratio = position_bytes[name] / position_bytes["float32"]
    step_ratio = statistics.median(t / f for t, f in zip(times[name], times["float32"]))
    step_bytes_ratio = step_bytes[name] / step_bytes["float32"]
    attention_ratio = statistics.median(t / f for t, f in zip(attention[name], attention["float32"]))
    rows[name] = {
      "kernel": attention_kernel.uses_kernel(cfg.compute_dtype, caches[name].route),
      "bytes_per_position": position_bytes[name],
      "bytes_ratio": bytes_ratio,
      "step_ms": statistics.median(times[name]) * 1e3,
      "step_ratio": step_ratio,
      "step_ratio_per_round": [t / f for t, f in zip(times[name], times["float32"])],
      "step_met": step_ratio <= 1.0,
      "step_bytes_ratio": step_bytes_ratio,
      "attention_ms": statistics.median(attention[name]) * 1e3,
      "attention_ratio": attention_ratio,
      "target_ratio": TARGET_SLACK * bytes_ratio,
      "attention_met": attention_ratio <= TARGET_SLACK * bytes_ratio,
    }
  return {
    "benchmark": "codecs",
    "backend": jax.default_backend(),
    "model": cfg.to_dict(),
    "weights": weights,
    "weight_bytes": weight_bytes,
    "batch": batch,
    "context": context,
    "repeats": repeats,
    "codecs": rows,
  }


def run(config: CodecsConfig, *, codecs: list, batch: int, context: int, repeats: int, weights: list) -> dict:
  if len(weights) != 1:
    raise ValueError(f"--weights takes one format, got {','.join(weights)}")
  return bench_codecs(
    config.model, codecs=tuple(codecs), batch=batch, context=context, repeats=repeats, weights=weights[0]
  )


BENCHMARK = Benchmark(
  name="codecs",
  summary="the decode step over each cache codec against float32's, beside the bytes each reads",
  run=run,
  options=(
    Option(
      "codecs",
      ["bfloat16", "float16", "int8", "float8_e4m3fn", "int4"],
      "cache codecs beside float32 (also int8+hadamard, int4+hadamard, kivi2, kivi4)",
      Kind.NAMES,
      tuple(VARIANTS),
    ),
    Option("batch", 8, "sequences (rows) per step"),
    Option("context", 2048, "positions cached per row"),
    Option("repeats", 5, "alternated timed rounds after a warm-up (median)"),
    Option("weights", ["int8"], "the format the weights are stored in (one)", Kind.NAMES, FORMATS),
  ),
  config=CodecsConfig(),
  description=__doc__,
)
