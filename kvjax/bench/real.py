"""`kvjax bench real --model smollm2-135m`: a pretrained model in kvjax beside `transformers`, on
the jobs its speed is judged by, every figure from one run on one machine.

  bandwidth   the machine's memory read rate (GB/s): a jitted sum over 1 GiB of float32.
  decode      greedy generation, 128-token prompts + 128 new tokens at batch 1 and 8, format for
              format (kvjax.bench.parts.real_formats): rows kvjax_{float32,bfloat16,int8} beside
              hf_{float32,bfloat16,int8} (transformers' model, its bfloat16 copy, its
              quantize_dynamic int8 copy; static cache) and, at batch 1 with --llamacpp-python,
              llamacpp_{f32,q8_0} (else `llamacpp_skipped` says why); all in alternating
              rounds. Each row: tokens_per_s (whole generate call), seconds (the rounds);
              agreement_with_float32 / agreement_with_kvjax_float32
              (kvjax.bench.base.harness.greedy_agreement); kvjax rows: weight_gb_per_s, bandwidth_fraction,
              over_hf_same_format, over_hf_best, over_llamacpp_{f32,q8_0} (float32, int8);
              llamacpp rows: own_prefill_s, own_decode_tokens_per_s, gguf.
  perplexity  held-out prose perplexity of each weight format against float32 (kvjax's plain
              forward pass, `windows` windows of 1,024 tokens).
  perplexity  also of each cache codec (int4 also rotated, KIVI 2 and 4 bits: CACHE_CODECS), read
              through the cache as a decode reads it.
  prefill     batch x 2,048-token prompts, the same kvjax and hf rows in alternating rounds
              (--prefill-repeats): seconds (median), rounds_s, tokens_per_s, peak_gib (the
              process's peak resident memory), next_token_agrees_with_float32, and for kvjax
              over_hf_same_format, over_hf_best. kvjax's prefill is blocked attention,
              transformers' its forward pass (SDPA).
  hf_int8     what transformers' int8 copy holds: Linear layers quantized (the lm_head among
              them), the qscheme, the parameters left float32.
  long        whole requests of batch x (2,048 + 256) tokens, each side in its own process
              (kvjax.bench.real_long, `kvjax bench real_long` for every shape): prefill, decode and
              request seconds, peak resident memory and KV bytes, kvjax's float32 and int8
              caches against transformers' static and dynamic caches, float32 weights.
  engine      a seeded workload of chat requests (prose in the chat template, 32-512 prompt
              tokens, 32-256 new tokens, Poisson arrivals) through kvjax.Engine and through
              transformers' continuous batching: requests and tokens per second, time to first
              token and per-token latency (p50 / p95).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from kvjax.bench.codecs import VARIANTS
from kvjax.bench.parts.engine_workload import Workload, bench_engine
from kvjax.bench.peers.llamacpp import check_python
from kvjax.bench.parts.real_formats import bench_decode, bench_prefill, hf_formats
from kvjax.bench.real_long import bench_long_requests
from kvjax.bench.peers.hf_model import check_source, load_both
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.interop.gguf_file import is_gguf
from kvjax.model.weights import FORMATS, store
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset
from kvjax.training.evaluate import evaluate

PARTS = ("decode", "perplexity", "prefill", "long", "engine")
CACHE_CODECS = ("float32", "bfloat16", "int8", "int4", "int4+hadamard", "kivi2", "kivi4")  # kvjax.bench.codecs.VARIANTS


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
  """The machine's read rate, GB/s, best of `repeats`: XLA's max over `gib` GiB of float32, and
  the CPU matmul kernel streaming a matrix of that size for 2 rows (both threads); `gb_per_s` is
  the larger, the figure the weight reads are measured against."""
  from kvjax.kernels import matmul

  x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
  rates = {"xla_max_gb_per_s": _rate(jax.jit(jnp.max), (x,), x.nbytes, repeats)}
  if matmul.kernel_available():
    w = x.reshape(2**13, -1)
    rows = jnp.ones((2, w.shape[0]), jnp.float32)
    rates["kernel_stream_gb_per_s"] = _rate(jax.jit(matmul.small_matmul), (rows, w), w.nbytes, repeats)
  return {**rates, "gb_per_s": max(rates.values())}


def _rate(fn, args, nbytes: int, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return nbytes / best / 1e9


def bench_perplexity_formats(model, params, tokenizer, *, seq_len, windows):
  """Held-out perplexity of each weight format (float32 cache) and of each cache codec (float32
  weights, read through the cache as a decode does) against float32."""
  data = load_dataset(DataConfig(source=PROSE, seq_len=seq_len), tokenizer)
  run = lambda p, cache=None: evaluate(model, p, data, batch_size=windows, num_batches=1, cache_config=cache)
  out = {"seq_len": seq_len, "windows": windows, "weights": {}, "cache": {}}
  base = run(params)["perplexity"]
  for fmt in FORMATS:
    out["weights"][fmt] = base if fmt == "float32" else run(store(params, fmt))["perplexity"]
  for codec in CACHE_CODECS:
    out["cache"][codec] = run(params, VARIANTS[codec])["perplexity"]
  for group in ("weights", "cache"):
    out[f"{group}_relative"] = {name: value / base - 1 for name, value in out[group].items()}
  return out

  return out


def bench_real(
  source: str,
  *,
  parts=PARTS,
  repeats: int = 2,
  prompt: int = 128,
  new_tokens: int = 128,
  long_batch: int = 8,
  long_prompt: int = 2048,
  long_new: int = 256,
  long_weights: str = "float32",
  windows: int = 4,
  seq_len: int = 1024,
  workload: Workload = Workload(),
  prefill_repeats: int = 1,
  llamacpp_python: str | None = None,
  progress=None,
) -> dict:
  """The parts named in `parts` (PARTS), as one JSON-able dict; progress(part, result), when
  given, is called as each part ends, with the result so far."""
  model, params, tokenizer, hf_model, versions = load_both(source)
  result = {"benchmark": "real", "model": model.config.to_dict(), **versions, "parts": list(parts)}
  result["bandwidth"] = memory_bandwidth()
  bandwidth = result["bandwidth"]["gb_per_s"]
  if "decode" in parts or "prefill" in parts or "long" in parts:
    hf_models, result["hf_int8"] = hf_formats(hf_model)
  if "decode" in parts:
    llamacpp = _llamacpp_peer(llamacpp_python, Path(versions["source"]))
    result["decode"] = bench_decode(
      model,
      params,
      tokenizer,
      hf_models,
      bandwidth,
      batches=(1, 8),
      prompt=prompt,
      new_tokens=new_tokens,
      repeats=repeats,
      llamacpp=llamacpp,
    )
    _report(progress, "decode", result)
  if "perplexity" in parts:
    result["perplexity"] = bench_perplexity_formats(model, params, tokenizer, seq_len=seq_len, windows=windows)
    _report(progress, "perplexity", result)
  if "prefill" in parts:
    result["prefill"] = bench_prefill(
      model,
      params,
      tokenizer,
      hf_models,
      batch=long_batch,
      prompt=long_prompt,
      max_len=long_prompt + long_new,
      repeats=prefill_repeats,
    )
    _report(progress, "prefill", result)
  hf_models = None  # the bfloat16 and int8 copies go before the long and engine parts
  if "long" in parts:
    result["long"] = bench_long_requests(
      source, prompts=(long_prompt,), batches=(long_batch,), new_tokens=long_new, weights=(long_weights,)
    )
    _report(progress, "long", result)
  if "engine" in parts:
    result["engine"] = bench_engine(model, params, tokenizer, hf_model, workload)
  return result


def _llamacpp_peer(python: str | None, source: Path) -> dict:
  """bench_decode's `llamacpp`: {"python", "gguf"} to run llama.cpp's rows, or {"skipped": why}."""
  why = check_python(python)
  if why is None and not is_gguf(source):
    why = f"{source} is not a GGUF file, the only input llama.cpp reads"
  return {"skipped": why} if why else {"python": python, "gguf": source}


def _report(progress, part: str, result: dict) -> None:
  if progress is not None:
    progress(part, result)


def print_progress(part: str, result: dict) -> None:
  """Each part's result so far on stderr as it ends: a long run's figures survive an interruption."""
  print(f"kvjax bench real: {part} done: {json.dumps(result)}", file=sys.stderr, flush=True)


def run(*, model: str, parts: list[str], repeats: int, prefill_repeats: int, llamacpp_python: str | None) -> dict:
  check_source(model)
  check_python(llamacpp_python)
  return bench_real(
    model,
    parts=parts,
    repeats=repeats,
    prefill_repeats=prefill_repeats,
    llamacpp_python=llamacpp_python,
    progress=print_progress,
  )


BENCHMARK = Benchmark(
  name="real",
  summary="a pretrained model in kvjax beside transformers: decode, perplexity, prefill, long context, engine",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("parts", list(PARTS), "comma-separated parts to run", Kind.NAMES, choices=PARTS),
    Option("repeats", 3, "alternating timed rounds of the decode part (median)"),
    Option("prefill_repeats", 1, "alternating timed rounds of the prefill part (median)"),
    Option(
      "llamacpp_python",
      None,
      "the Python of an environment with llama-cpp-python: adds llama.cpp's f32 and q8_0 rows at batch 1",
      Kind.PROGRAM,
    ),
  ),
  description=__doc__,
)
