"""What every benchmark shares: harness (the benchmark model, its weights and caches, the timed
decode step, greedy agreement, the machine's rooflines) and registry (what a benchmark declares,
and the benchmarks found in kvjax.bench)."""
