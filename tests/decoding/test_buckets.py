"""A loop over prompts of any lengths compiles a bounded number of functions: prefill, extend and
decode_step pad prompt widths and cache lengths to buckets, and what callers see does not change
(logits of the caller's width and values, a cache that holds what was asked and no more)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import init_params, tiered, tiny_config
from kvjax.cache import kinds
from kvjax.cache.presses import KNorm, SnapKV
from kvjax.decoding.decode import forward

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
LAYOUTS = {
  "contiguous": kvjax.CacheConfig(),
  "paged-int8": kvjax.CacheConfig(layout="paged", page_size=8, dtype="int8"),
  "evict": kvjax.CacheConfig(press=KNorm()),  # compression_ratio 0: its budget is max_len
}
ROUNDS = 50  # per half; each round is a prefill, an extend and a decode_step


def sizes(j: int, shift: int) -> tuple[int, int, int]:
  """(prompt width, max_len, extend chunk) of round j: odd in the first half (shift 0), one more
  in the second (shift 1). An odd n >= 1 and n + 1 share their bucket (every rung is even), so the second
  half's sizes, never seen before, fall in buckets the first half has seen."""
  width, chunk = 2 * (j % 15) + 1, 2 * (j % 4) + 1
  return width + shift, width + 2 * (j % 8) + 16 + shift, chunk + shift


def buckets(n: int) -> int:
  """The rung of the ladder a size falls in (four rungs per octave from 16: 16, 20, 24, 28, 32,
  40, ...), for the bound on compilations."""
  step = max(1, (1 << (n - 1).bit_length()) // 8)
  return max(16, -(-n // step) * step)


class Compilations:
  """Counts backend compilations (jax.monitoring events) while active."""

  def __init__(self):
    self.count = 0

  def __call__(self, event: str, duration: float, **kwargs):
    if event == BACKEND_COMPILE:
      self.count += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)


def memory_maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def one_round(model, params, cache_config, width, max_len, chunk, rng):
  tokens = rng.integers(0, 64, (1, width + 2))  # two columns of padding past the prompt
  _, cache = kvjax.prefill(model, params, tokens, [width], max_len, logits="last", cache_config=cache_config)
  _, cache = kvjax.extend(model, params, cache, rng.integers(0, 64, (1, chunk)), [chunk])
  logits, _ = kvjax.decode_step(model, params, cache, rng.integers(0, 64, (1,)))
  return logits


@pytest.mark.tier2  # 300 calls; each bucketed call's oracle is the first tier's test below
def test_a_loop_over_distinct_lengths_compiles_a_bounded_number_of_functions():
  """300 calls (prefill, extend, decode_step over three cache kinds), no two rounds of the same
  (prompt width, cache length): the second half, of sizes never seen, compiles nothing new
  (unbucketed code compiles a function for each of its calls), the whole loop a few functions
  per bucket key, and the process's memory maps stop growing."""
  model, params = init_params(tiny_config(2, num_layers=1, max_len=64))
  rng = np.random.default_rng(0)
  kinds = list(LAYOUTS.values())
  keys = set()
  with Compilations() as compiled:
    for j in range(ROUNDS):
      width, max_len, chunk = sizes(j, 0)
      kind = j % len(kinds)
      one_round(model, params, kinds[kind], width, max_len, chunk, rng)
      keys |= {("prefill", kind, buckets(width + 2), buckets(max_len)), ("extend", kind, buckets(max_len))}
    first_half, maps = compiled.count, memory_maps()
    for j in range(ROUNDS):
      width, max_len, chunk = sizes(j, 1)
      one_round(model, params, kinds[j % len(kinds)], width, max_len, chunk, rng)
  second_half = compiled.count - first_half
  growth = memory_maps() - maps
  # Per bucket key a compiled forward (prefill's, or extend's and decode_step's over one cache
  # size) and the small programs that make a cache's arrays.
  bound = 4 * len(keys)
  assert second_half <= 2, f"{second_half} compilations for {3 * ROUNDS} calls in buckets already seen"
  assert compiled.count <= bound, f"{compiled.count} compilations for {len(keys)} bucket keys"
  assert growth < 100, f"memory maps grew by {growth} over {3 * ROUNDS} calls"


# The unbucketed oracle: the same forward over a cache of exactly the asked size and tokens of
# exactly the caller's width.
exact = jax.jit(forward, static_argnames=("model", "last", "from_empty"))

CASES = {
  "contiguous-int8": ({}, kvjax.CacheConfig(dtype="int8")),
  "windowed": ({"window": (8, 0), "sink_tokens": 2}, kvjax.CacheConfig()),
  "paged": ({}, kvjax.CacheConfig(layout="paged", page_size=3)),
  "evict": ({}, kvjax.CacheConfig(press=KNorm(compression_ratio=0.5))),
  "evict-adaptive": (
    {},
    kvjax.CacheConfig(press=SnapKV(compression_ratio=0.5, window=2, heads="adaptive")),
  ),
  "mla": ({"kv_latent_rank": 12, "rope_dims": 8}, kvjax.CacheConfig()),
  "mla-paged-int8": (
    {"kv_latent_rank": 12, "rope_dims": 8},
    kvjax.CacheConfig(layout="paged", page_size=3, dtype="int8"),
  ),
}
MAX_LEN = 30  # no bucket's size: the storage is 32 positions (33 in pages of 3)
PROMPT, PROMPT_LENGTHS = 11, np.array([11, 5])
CHUNK, CHUNK_LENGTHS = 9, np.array([3, 9])
STEPS = 16  # both rows then hold exactly MAX_LEN positions; the shorter one has evicted past its budget


@pytest.mark.parametrize("case", tiered(list(CASES), ("windowed", "evict-adaptive", "mla-paged-int8")))
def test_bucketed_calls_give_the_unbucketed_logits_and_hold_what_was_asked(case):
  """prefill, extend and decode_step through a bucketed cache == the same forward through a cache
  of exactly max_len (or the evicting budget) at the caller's widths; logits="all" have the
  caller's width; the cache takes MAX_LEN positions and refuses one more, naming MAX_LEN."""
  changes, cache_config = CASES[case]
  model, params = init_params(tiny_config(2, **changes))
  rng = np.random.default_rng(1)
  prompt, chunk = rng.integers(0, 64, (2, PROMPT)), rng.integers(0, 64, (2, CHUNK))
  steps = rng.integers(0, 64, (STEPS, 2))

  logits, cache = kvjax.prefill(model, params, prompt, PROMPT_LENGTHS, MAX_LEN, cache_config=cache_config)
  ref = kinds.create(model.config, cache_config, 2, MAX_LEN, prompt=PROMPT)
  want, ref = exact(model, params, ref, jnp.asarray(prompt, jnp.int32), jnp.asarray(PROMPT_LENGTHS), from_empty=True)
  assert logits.shape == (2, PROMPT, 64) and cache.capacity == MAX_LEN
  # The storage is a bucket's, larger than asked (an evicting cache's slots, 24 here, may be a rung).
  assert cache.nbytes > ref.nbytes or (case.startswith("evict") and cache.nbytes == ref.nbytes)
  for row, n in enumerate(PROMPT_LENGTHS):
    np.testing.assert_allclose(logits[row, :n], want[row, :n], atol=1e-5)

  logits, cache = kvjax.extend(model, params, cache, chunk, CHUNK_LENGTHS)
  want, ref = exact(model, params, ref, jnp.asarray(chunk, jnp.int32), jnp.asarray(CHUNK_LENGTHS))
  assert logits.shape == (2, CHUNK, 64)
  for row, n in enumerate(CHUNK_LENGTHS):
    np.testing.assert_allclose(logits[row, :n], want[row, :n], atol=1e-5)

  ones = jnp.ones((2,), jnp.int32)
  for token in steps:
    logits, cache = kvjax.decode_step(model, params, cache, token)
    want, ref = exact(model, params, ref, jnp.asarray(token, jnp.int32)[:, None], ones, last=True)
    np.testing.assert_allclose(logits, want, atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [MAX_LEN, MAX_LEN])
  with pytest.raises(ValueError, match=f"do not fit its {MAX_LEN} positions"):
    kvjax.decode_step(model, params, cache, steps[0])
