"""`kvjax bench nocache` at toy size: every baseline gives the cached tokens (speed is not tested)."""

from __future__ import annotations

from kvjax.bench import nocache


def test_bench_nocache_baselines_give_the_cached_tokens(bench_model):
  result = nocache.bench_nocache(bench_model, prompt=4, new_token_counts=(6,), concat_max=6, repeats=1)
  row = result["rows"][0]
  assert row["nocache_same_tokens"] and row["doubling_same_tokens"] and row["concat_same_tokens"]


def test_the_concat_cache_runs_up_to_concat_max(bench_model):
  """It compiles once per length, so longer runs leave it out."""
  result = nocache.bench_nocache(bench_model, prompt=4, new_token_counts=(3, 5), concat_max=4, repeats=1)
  assert ["concat_s" in row for row in result["rows"]] == [True, False]
