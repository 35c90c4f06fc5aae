"""Wall-clock timing of jitted calls, for the benchmarks and the studies. Only jax and the
standard library: every layer may use it."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

import jax


def timed_alternating(fns: dict[Hashable, Callable[[], object]], repeats: int) -> dict[Hashable, list[float]]:
  """Wall seconds of each fn over `repeats` rounds that call every fn once, after one warm-up
  each: load from other processes falls on all of them alike."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return times


def timed(fn: Callable[[], object], repeats: int) -> float:
  """Median wall seconds of fn() over `repeats` runs, after one warm-up (compilation) run."""
  return statistics.median(timed_alternating({"fn": fn}, repeats)["fn"])
