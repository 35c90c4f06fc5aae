"""`kvjax bench engine --model smollm2-135m`: a seeded workload of chat requests (prose in the
chat template, 32-512 prompt tokens, 32-256 new tokens, Poisson arrivals at 4 per second) served by
kvjax.Engine and by transformers with the weights in the same format on both sides, one run per
format in --weights: transformers' continuous batching, or its padded static batching where
continuous batching does not finish within --time-limit seconds (the JSON says which ran and why;
--peer static asks for it directly). Each side reports requests and tokens per second, time to
first token, per-request latency (arrival to last token) and per-token latency (p50 / p99); the
greedy agreement of the answers, request by request; the ratios of throughput and p99 latency.
--steps runs the engine more than once, with its mixed steps on or off (`--peer none`: the engine
alone), each later run's tokens per second beside the first's.
"""

from __future__ import annotations

import os

from kvjax.bench.parts.engine_workload import Workload, bench_engine
from kvjax.bench.peers.hf_model import check_source, import_torch, load_both
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.model.weights import FORMATS


def run(*, model: str, requests: int, weights: list[str], time_limit: int, peer: list[str], steps: list[str]) -> dict:
  torch, _ = import_torch()
  torch.set_num_threads(os.cpu_count() or 1)  # every core, as XLA uses them
  check_source(model)
  if len(peer) != 1:
    raise ValueError(f"--peer takes one of continuous, static, none, got {','.join(peer)}")
  kvjax_model, params, tokenizer, hf_model, versions = load_both(model)
  workload = Workload(requests=requests)
  out = {"benchmark": "engine", **versions}
  for name in weights:
    out[name] = bench_engine(
      kvjax_model,
      params,
      tokenizer,
      hf_model,
      workload,
      weights=name,
      time_limit=time_limit,
      peer=peer[0],
      steps=tuple(steps),
    )
  return out


BENCHMARK = Benchmark(
  name="engine",
  summary="a seeded chat workload (Poisson arrivals) through kvjax.Engine and transformers, format for format",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("requests", 64, "requests in the workload (4 per second on average)"),
    Option(
      "weights", ["float32"], "comma-separated weight formats, each run on both sides", Kind.NAMES, choices=FORMATS
    ),
    Option("time_limit", 1800, "seconds the peer's continuous batching may take before static batching replaces it"),
    Option(
      "peer",
      ["continuous"],
      "transformers' continuous or static batching, or none (the engine alone)",
      Kind.NAMES,
      choices=("continuous", "static", "none"),
    ),
    Option(
      "steps",
      ["mixed"],
      "the engine's runs in order: mixed (a context's chunk in the decode rows' call) or separate "
      "(in a call of its own); e.g. mixed,separate,mixed,separate alternates them",
      Kind.NAMES,
      choices=("mixed", "separate"),
    ),
  ),
  description=__doc__,
)
