"""`kvjax bench prefill`: kvjax's prefill of a batch of long prompts against `transformers`'
forward pass over the same prompts, format for format, in alternating rounds.

Both sides load the same file (kvjax.bench.peers.hf_model.load_both) and take the same prose prompts.
kvjax runs `prefill` into a contiguous cache with the last position's logits only; `transformers`
runs its model with its dynamic cache and `logits_to_keep=1`, so both compute every layer's keys
and values and one position's logits. Per weight format (float32: both sides float32; bfloat16:
kvjax's weights stored in bfloat16 against transformers' model cast to bfloat16), the two sides
are timed in rounds that call each once, after a warm-up each, so load from other processes falls
on both alike; `over_hf` is the ratio of the medians (above 1: kvjax is faster).
"""

from __future__ import annotations

import copy
import statistics

import jax
import numpy as np

from kvjax.bench.peers.hf_model import check_source, import_torch, load_both, prose_prompts
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.decoding import decode
from kvjax.model.weights import store
from kvjax.timing import timed_alternating

FORMATS = ("float32", "bfloat16")  # the weight formats both sides run


def bench_prefill(source: str, *, batch: int = 8, prompt: int = 2048, formats=FORMATS, repeats: int = 2) -> dict:
  """Seconds and tokens/s of one prefill of `batch` x `prompt` tokens per side and format, medians
  of `repeats` alternating rounds, with each round's seconds."""
  torch, _ = import_torch()
  model, params, tokenizer, hf_model, versions = load_both(source)
  prompts = prose_prompts(tokenizer, batch, prompt)
  lengths = np.full((batch,), prompt, np.int32)
  ids = torch.from_numpy(prompts.astype(np.int64))
  tokens = batch * prompt
  result = {"benchmark": "prefill", "model": model.config.to_dict(), **versions}
  result |= {"batch": batch, "prompt": prompt, "repeats": repeats, "formats": {}}
  for fmt in formats:
    stored = store(params, fmt)
    theirs = hf_model if fmt == "float32" else copy.deepcopy(hf_model).to(getattr(torch, fmt))

    def ours():
      return decode.prefill(model, stored, prompts, lengths, prompt, logits="last")[0]

    def hf():
      with torch.inference_mode():
        return theirs(ids, use_cache=True, logits_to_keep=1).logits

    times = timed_alternating({"kvjax": ours, "hf": hf}, repeats)
    row = {}
    for side, seconds in times.items():
      median = statistics.median(seconds)
      row[side] = {"seconds": median, "tokens_per_s": tokens / median, "rounds": seconds}
    row["over_hf"] = row["hf"]["seconds"] / row["kvjax"]["seconds"]
    result["formats"][fmt] = row
    jax.clear_caches()
  return result


def run(*, model: str, batch: int, prompt: int, formats: list[str], repeats: int) -> dict:
  check_source(model)
  return bench_prefill(model, batch=batch, prompt=prompt, formats=formats, repeats=repeats)


BENCHMARK = Benchmark(
  name="prefill",
  summary="a pretrained model's prefill beside transformers', format for format, alternating rounds",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("batch", 8, "prompts (rows) per prefill"),
    Option("prompt", 2048, "tokens per prompt"),
    Option("formats", list(FORMATS), "comma-separated weight formats", Kind.NAMES, choices=FORMATS),
    Option("repeats", 2, "alternating timed rounds per format after a warm-up each (median)"),
  ),
  description=__doc__,
)
