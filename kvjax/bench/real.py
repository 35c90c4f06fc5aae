"""`kvjax bench real --model smollm2-135m`: a pretrained model in kvjax beside `transformers`, on
the jobs its speed is judged by, every figure from one run on one machine.

  bandwidth   the machine's memory read rate (GB/s): a jitted sum over 1 GiB of float32.
  decode      greedy generation, 128-token prompts + 128 new tokens at batch 1 and 8, with the
              weights stored in each format (kvjax.model.weights) against transformers' float32
              and bfloat16 models (static cache); at batch 1, the weight bytes read per second
              and their fraction of the bandwidth.
  perplexity  held-out prose perplexity of each weight format against float32 (kvjax's plain
              forward pass, `windows` windows of 1,024 tokens).
  perplexity  also of each cache codec, read through the cache as a decode reads it.
  prefill     batch x 2,048-token prompts: tokens/s and the process's peak resident memory,
              kvjax's prefill (blocked attention) with each weight format against transformers'
              float32 forward pass (SDPA).
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

import copy
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.engine_workload import Workload, bench_engine
from kvjax.bench.real_model import check_source, hf_greedy_kwargs, import_torch, load_both, prose_prompts
from kvjax.bench.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.cache.config import CacheConfig
from kvjax.decoding import decode
from kvjax.model.weights import FORMATS, store, weight_bytes
from kvjax.timing import timed_alternating
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset
from kvjax.training.evaluate import evaluate

PARTS = ("decode", "perplexity", "prefill", "long", "engine")
CACHE_CODECS = ("float32", "bfloat16", "int8", "int4")


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


def reset_peak_memory() -> None:
  """Resets the process's peak resident memory (Linux: VmHWM), so the next reading is one phase's."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass


def peak_memory_gib() -> float | None:
  """The process's peak resident memory since the last reset, GiB (None where /proc has none)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  return None


def _hf_generate(torch, hf_model, prompts: np.ndarray, new_tokens: int):
  input_ids = torch.from_numpy(prompts.astype(np.int64))
  kwargs = hf_greedy_kwargs(torch, input_ids, new_tokens)

  def run():
    with torch.inference_mode():
      return hf_model.generate(input_ids, **kwargs)[:, prompts.shape[1] :].numpy()

  return run


def bench_decode_formats(model, params, tokenizer, hf_models, bandwidth, *, batches, prompt, new_tokens, repeats):
  torch, _ = import_torch()
  stored = {fmt: store(params, fmt) for fmt in FORMATS}
  rows = []
  for batch in batches:
    prompts = prose_prompts(tokenizer, batch, prompt)
    lengths = np.full((batch,), prompt, np.int32)
    fns = {
      f"kvjax_{fmt}": (lambda p=p: decode.generate(model, p, prompts, lengths, new_tokens)) for fmt, p in stored.items()
    }
    fns |= {f"hf_{name}": _hf_generate(torch, m, prompts, new_tokens) for name, m in hf_models.items()}
    reference = np.asarray(fns["hf_float32"]())
    times = timed_alternating(fns, repeats)
    row = {"batch": batch}
    for name, fn in fns.items():
      seconds = statistics.median(times[name])
      row[name] = {"tokens_per_s": batch * new_tokens / seconds, "seconds": times[name]}
      if name.startswith("kvjax_"):
        fmt = name.removeprefix("kvjax_")
        row[name]["greedy_tokens_agree_with_hf_float32"] = float((np.asarray(fn()) == reference).mean())
        row[name]["weight_gb_per_s"] = weight_bytes(stored[fmt]) * new_tokens / seconds / 1e9
        row[name]["bandwidth_fraction"] = row[name]["weight_gb_per_s"] / bandwidth
    best_hf = max(row[f"hf_{n}"]["tokens_per_s"] for n in hf_models)
    for fmt in FORMATS:
      row[f"kvjax_{fmt}"]["over_hf_float32"] = row[f"kvjax_{fmt}"]["tokens_per_s"] / row["hf_float32"]["tokens_per_s"]
      row[f"kvjax_{fmt}"]["over_hf_best"] = row[f"kvjax_{fmt}"]["tokens_per_s"] / best_hf
    rows.append(row)
  return {
    "prompt": prompt,
    "new_tokens": new_tokens,
    "weight_bytes": {f: weight_bytes(p) for f, p in stored.items()},
    "rows": rows,
  }


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
    out["cache"][codec] = run(params, CacheConfig(dtype=codec))["perplexity"]
  for group in ("weights", "cache"):
    out[f"{group}_relative"] = {name: value / base - 1 for name, value in out[group].items()}
  return out


def bench_prefill(model, params, tokenizer, hf_model, *, batch, prompt, max_len):
  """kvjax prefill (last logits) with the weights in each format vs transformers' float32
  forward (dynamic cache, last logits): one timed run each after a warm-up, the process's peak
  resident memory during it."""
  torch, _ = import_torch()
  prompts = prose_prompts(tokenizer, batch, prompt)
  lengths = np.full((batch,), prompt, np.int32)
  ids = torch.from_numpy(prompts.astype(np.int64))

  def ours(p):
    return lambda: decode.prefill(model, p, prompts, lengths, max_len, logits="last")[0]

  def theirs():
    with torch.inference_mode():
      return hf_model(ids, use_cache=True, logits_to_keep=1).logits

  fns = {f"kvjax_{fmt}": ours(store(params, fmt)) for fmt in FORMATS} | {"hf_float32": theirs}
  out = {"batch": batch, "prompt": prompt}
  for name, fn in fns.items():
    jax.block_until_ready(fn())
    reset_peak_memory()
    start = time.perf_counter()
    jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    out[name] = {"seconds": seconds, "tokens_per_s": batch * prompt / seconds, "peak_gib": peak_memory_gib()}
  for name in fns:
    out[name]["over_hf"] = out[name]["tokens_per_s"] / out["hf_float32"]["tokens_per_s"]
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
  progress=None,
) -> dict:
  """The parts named in `parts` (PARTS), as one JSON-able dict; progress(part, result), when
  given, is called as each part ends, with the result so far."""
  torch, _ = import_torch()
  model, params, tokenizer, hf_model, versions = load_both(source)
  result = {"benchmark": "real", "model": model.config.to_dict(), **versions, "parts": list(parts)}
  result["bandwidth"] = memory_bandwidth()
  bandwidth = result["bandwidth"]["gb_per_s"]
  if "decode" in parts:
    hf_models = {"float32": hf_model, "bfloat16": _bf16_copy(torch, hf_model)}
    result["decode"] = bench_decode_formats(
      model,
      params,
      tokenizer,
      hf_models,
      bandwidth,
      batches=(1, 8),
      prompt=prompt,
      new_tokens=new_tokens,
      repeats=repeats,
    )
    del hf_models["bfloat16"]
    _report(progress, "decode", result)
  if "perplexity" in parts:
    result["perplexity"] = bench_perplexity_formats(model, params, tokenizer, seq_len=seq_len, windows=windows)
    _report(progress, "perplexity", result)
  if "prefill" in parts:
    result["prefill"] = bench_prefill(
      model,
      params,
      tokenizer,
      hf_model,
      batch=long_batch,
      prompt=long_prompt,
      max_len=long_prompt + long_new,
    )
    _report(progress, "prefill", result)
  if "long" in parts:
    from kvjax.bench.real_long import bench_long_requests  # it imports this module's memory readers

    result["long"] = bench_long_requests(
      source, prompts=(long_prompt,), batches=(long_batch,), new_tokens=long_new, weights=(long_weights,)
    )
    _report(progress, "long", result)
  if "engine" in parts:
    result["engine"] = bench_engine(model, params, tokenizer, hf_model, workload)
  return result


def _report(progress, part: str, result: dict) -> None:
  if progress is not None:
    progress(part, result)


def _bf16_copy(torch, hf_model):
  return copy.deepcopy(hf_model).to(torch.bfloat16)


def print_progress(part: str, result: dict) -> None:
  """Each part's result so far on stderr as it ends: a long run's figures survive an interruption."""
  print(f"kvjax bench real: {part} done: {json.dumps(result)}", file=sys.stderr, flush=True)


def run(*, model: str, parts: list[str], repeats: int) -> dict:
  check_source(model)
  return bench_real(model, parts=parts, repeats=repeats, progress=print_progress)


BENCHMARK = Benchmark(
  name="real",
  summary="a pretrained model in kvjax beside transformers: decode, perplexity, prefill, long context, engine",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("parts", list(PARTS), "comma-separated parts to run", Kind.NAMES, choices=PARTS),
    Option("repeats", 3, "alternating timed rounds of the decode part (median)"),
  ),
  description=__doc__,
)
