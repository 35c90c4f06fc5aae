"""The decode step's timer, shared by the benchmarks (kvjax.bench.base.harness) and the studies
(kvjax.studies.base.measure): wall seconds of `decode_step` calls on a cache, the cache donated from
step to step."""

from __future__ import annotations

import time

import jax
import numpy as np

from kvjax.decoding import decode

WARMUP = 2  # the second call compiles for the cache the first returns (its arrays are new)


def decode_step_seconds(model, params, cache, steps: int) -> list[float]:
  """Seconds of each of `steps` decode steps of every row of `cache` (token 0 fed), after WARMUP
  steps; a cache without room for them all is refused before the first."""
  tokens = np.zeros((cache.lengths.shape[0],), np.int32)
  cache.check_room(np.full(tokens.shape, steps + WARMUP))
  times = []
  for i in range(steps + WARMUP):
    start = time.perf_counter()
    logits, cache = decode.decode_step(model, params, cache, tokens)
    jax.block_until_ready(logits)
    if i >= WARMUP:
      times.append(time.perf_counter() - start)
  return times
