"""Parts of the larger benchmarks, each over the peers and the harness: engine_workload (the chat
workload of `kvjax bench engine` and `real`), real_formats (`real`'s decode and prefill format for
format), real_long_side (one side of a `real_long` cell, run in its own process)."""
