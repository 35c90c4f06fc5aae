"""The peers kvjax's benchmarks measure beside it, one module each: `transformers` (hf_model: the
pretrained model and its generation settings, with the process's peak memory; hf_engine: its
static and continuous batching), and llama.cpp through llama-cpp-python in a side environment
(llamacpp). The benchmarks are the modules of kvjax.bench that declare a BENCHMARK; what they
share is kvjax.bench.base.harness."""
