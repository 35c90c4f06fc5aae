"""What the benchmarks on the benchmark model share: the model (BENCH_MODEL, changed with
`--set model.FIELD=VALUE` through BenchConfig), its random weights, caches filled with random
positions, the timed decode step, the greedy agreement of two sides' answers, and the machine's
rooflines (memory bandwidth, matmul FLOP/s) that decode steps are measured against. The wall-clock timing itself is kvjax.timing's.
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kinds
from kvjax.cache.base import KVCache
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.fill import filled
from kvjax.config import ModelConfig
from kvjax.decoding import decode
from kvjax.decoding.step_timer import decode_step_seconds
from kvjax.model.flops import matmul_params
from kvjax.model.transformer import Transformer
from kvjax.timing import timed, timed_alternating

# The Llama-style reference config of the benchmarks.
BENCH_MODEL = ModelConfig(
  vocab_size=4096, d_model=512, num_layers=8, num_heads=8, num_kv_heads=2, mlp_dim=1408, max_len=2048
)


# SmolLM2-135M's shapes (kvjax.interop reads the same from its GGUF); tied embeddings, RoPE.
SMOLLM2_SHAPES = ModelConfig(
  vocab_size=49152,
  d_model=576,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  head_dim=64,
  mlp_dim=1536,
  activation="swiglu",
  norm="rmsnorm",
  positions="rope",
  rope_theta=100000.0,
  tie_embeddings=True,
  max_len=8192,
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What --set changes in a benchmark on the benchmark model: the model (model.FIELD)."""

  model: ModelConfig = BENCH_MODEL


def memory_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
  """Bytes/s that a jitted reduction streams from memory: the decode-step ceiling."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return num_bytes / timed(lambda: total(x), repeats)


def weight_bytes(cfg: ModelConfig) -> int:
  """Bytes of the weights one decode step reads (embedding rows gathered are negligible)."""
  return matmul_params(cfg) * 4


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, cache_config: CacheConfig = CacheConfig()) -> int:
  """Bytes one decode step at `context` positions per row reads: the weights and each row's
  cache (values and scales, a windowed layer's window and sinks only: kinds.sequence_bytes)."""
  return weight_bytes(cfg) + batch * kinds.sequence_bytes(cfg, cache_config, context)


def prefill_flops(cfg: ModelConfig, batch: int, prompt: int) -> float:
  attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt * prompt  # causal half of 4
  return batch * (2 * matmul_params(cfg) * prompt + attention)


def init_model(cfg: ModelConfig, seed: int = 0):
  model = Transformer(cfg)
  params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
  return model, params


STEP_REPEATS = 10  # timed decode steps per `time_decode_step`


def alternate_decode_steps(models: dict, caches: dict, batch: int, steps: int) -> tuple[dict, dict]:
  """Times decode steps of {name: (model, params)} over {name: cache} round-robin, `steps` rounds,
  each feeding token 0 to every row -> ({name: [seconds per step]}, {name: first step's logits})."""
  tokens = np.zeros((batch,), np.int32)
  first = {}

  def stepper(name):
    model, params = models[name]

    def step():
      logits, caches[name] = decode.decode_step(model, params, caches[name], tokens)
      first.setdefault(name, logits)
      return logits

    return step

  return timed_alternating({name: stepper(name) for name in caches}, steps), first


def filled_cache(
  model: Transformer, params, batch: int, context: int, max_len: int, cache_config: CacheConfig = CacheConfig()
) -> KVCache:
  """A cache of `cache_config` of max_len positions whose rows hold `context` random positions."""
  return filled(kinds.create(model.config, cache_config, batch, max_len), model.config, context)


def time_decode_step(model, params, cache, steps: int = STEP_REPEATS) -> float:
  """Median seconds of one `decode_step` (kvjax.decoding.step_timer, the studies' timer too)."""
  return statistics.median(decode_step_seconds(model, params, cache, steps))


def greedy_agreement(ours, theirs) -> dict:
  """Greedy agreement of answers with a reference's, answer by answer (token ids, rows of an array
  or lists of any lengths): answers (pairs compared); equal_answers (the fraction equal whole);
  equal_tokens (equal positions over the longer answer of each pair, summed); mean_prefix_fraction
  (the mean share of an answer before its first difference: a near-tie that flips one token
  changes every token after it); first_divergence (each pair's first differing position, None
  where equal). The one shape every benchmark reports."""
  pairs = [(list(map(int, a)), list(map(int, b))) for a, b in zip(ours, theirs)]
  if not pairs:
    raise ValueError("greedy_agreement: no answers to compare")
  first = []
  for a, b in pairs:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    first.append(None if a == b else at)
  longest = [max(len(a), len(b), 1) for a, b in pairs]
  return {
    "answers": len(pairs),
    "equal_answers": sum(f is None for f in first) / len(pairs),
    "equal_tokens": sum(sum(x == y for x, y in zip(a, b)) for a, b in pairs) / sum(longest),
    "mean_prefix_fraction": float(np.mean([1.0 if f is None else f / n for f, n in zip(first, longest)])),
    "first_divergence": first,
  }


def random_prompts(cfg: ModelConfig, batch: int, prompt: int, seed: int = 0):
  tokens = np.asarray(jax.random.randint(jax.random.key(seed), (batch, prompt), 0, cfg.vocab_size), np.int32)
  return tokens, np.full((batch,), prompt, np.int32)


def check_generation(cfg: ModelConfig, prompt: int, new_tokens: int) -> None:
  """Refuses, before the model is built, a generation longer than the model's context."""
  cfg.check_length(
    prompt + new_tokens - 1,
    f"--prompt {prompt} + {new_tokens} new tokens need {prompt + new_tokens - 1} cache positions",
  )
