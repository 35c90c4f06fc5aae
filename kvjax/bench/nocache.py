"""`kvjax bench nocache`: generation with the preallocated cache against the baselines of
kvjax.decoding.baselines (no cache, the concat cache, the doubling buffer), batch 1, each number
of new tokens in one run; each baseline's tokens are checked against the cached ones.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvjax.bench.base.harness import BENCH_MODEL, BenchConfig, check_generation, init_model, random_prompts
from kvjax.bench.base.registry import Benchmark, Kind, Option
from kvjax.config import ModelConfig
from kvjax.decoding import baselines, decode
from kvjax.timing import timed


def bench_nocache(
  cfg: ModelConfig = BENCH_MODEL,
  *,
  prompt: int = 128,
  new_token_counts: Sequence[int] = (64, 128, 256, 512),
  concat_max: int = 64,
  repeats: int = 5,
) -> dict:
  """Seconds to generate each of `new_token_counts` new tokens from one prompt of `prompt` tokens
  with the preallocated cache and with the baselines; the concat cache, which compiles once per
  length, only up to concat_max new tokens."""
  model, params = init_model(cfg)
  prompts, lengths = random_prompts(cfg, 1, prompt)
  rows = []
  for new in new_token_counts:
    expected = np.asarray(decode.generate(model, params, prompts, lengths, new))
    row = {"new_tokens": new, "cached_s": timed(lambda: decode.generate(model, params, prompts, lengths, new), repeats)}
    strategies = {"nocache": baselines.generate_nocache, "doubling": baselines.generate_doubling}
    if new <= concat_max:
      strategies["concat"] = baselines.generate_concat
    for name, fn in strategies.items():
      tokens = fn(model, params, prompts, lengths, new)
      row[f"{name}_s"] = timed(lambda: fn(model, params, prompts, lengths, new), 1)
      row[f"{name}_over_cached"] = row[f"{name}_s"] / row["cached_s"]
      row[f"{name}_same_tokens"] = bool((tokens == expected).all())
    rows.append(row)
  return {"benchmark": "nocache", "model": cfg.to_dict(), "batch": 1, "prompt": prompt, "rows": rows}


def run(config: BenchConfig, *, prompt: int, lengths: list[int], concat_max: int, repeats: int) -> dict:
  check_generation(config.model, prompt, max(lengths))
  return bench_nocache(config.model, prompt=prompt, new_token_counts=lengths, concat_max=concat_max, repeats=repeats)


BENCHMARK = Benchmark(
  name="nocache",
  summary="the preallocated cache vs no cache, the concat cache and the doubling buffer",
  run=run,
  options=(
    Option("prompt", 128, "prompt tokens"),
    Option("lengths", [64, 128, 256, 512], "comma-separated numbers of new tokens", Kind.COUNTS),
    Option("concat_max", 64, "longest run for the concat cache (it compiles once per length)", Kind.NONNEGATIVE),
    Option("repeats", 5, "timed runs of the cached generate after a warm-up (median)"),
  ),
  config=BenchConfig(),
  description=__doc__,
)
