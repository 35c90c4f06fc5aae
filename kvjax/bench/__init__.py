"""Benchmarks: `kvjax bench NAME` runs one (registry: their names and options), each printing JSON.

In layers that pyproject.toml's import contract keeps (every import points down):
  `real`          the real-model benchmark, composing codecs' and real_long's cells;
  the benchmarks  budget, codecs, decode, evict, hf, matmul, mla, nocache, perplexity, prefill,
                  quant, real_long, and serving/ (engine, engine_press, paged, load, prefix: the
                  engine's and `kvjax serve`'s) (none imports another);
  parts/          engine_workload (the chat workload both engines serve), real_formats (the weight
                  formats on each side), real_long_side (one cell of real_long, in its own process);
  peers/          transformers' model and engine, llama.cpp;
  base/           harness (timing in alternated rounds, greedy agreement, JSON) and registry.
"""
