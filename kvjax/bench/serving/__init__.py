"""The serving benchmarks: the engine against transformers, the pressed engine, the paged read,
and the load test of `kvjax serve`."""
