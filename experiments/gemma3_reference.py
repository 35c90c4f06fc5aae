"""Gemma 3 270M in kvjax against transformers' Gemma3ForCausalLM loaded from the same GGUF
(float32, eager attention), fed the same token ids: the largest logit difference over the
largest logit, at a prompt inside the sliding window (512 tokens) and one eight windows long
(4,096), and whether 32 greedy tokens after the 512-token prompt agree. Token ids are seeded
random ids in [3, vocab) after BOS 2, so no tokenizer takes part. Prints JSON.

  python experiments/gemma3_reference.py [LENGTH ...]
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import transformers

import kvjax
from kvjax.bench.peers.hf_model import hf_greedy_kwargs
from kvjax.interop.importer import from_gguf, resolve_source

BOS = 2
STRIDE = 8  # logits compared at every 8th position and the last 8: [T, 262144] float32 is 1 GiB per 1,024 tokens


def prompt_ids(length: int, vocab: int, seed: int = 0) -> np.ndarray:
  """int[length]: BOS, then seeded random ids in [3, vocab)."""
  ids = np.random.default_rng(seed).integers(3, vocab, size=length)
  ids[0] = BOS
  return ids.astype(np.int32)


def compared_positions(length: int) -> np.ndarray:
  return np.unique(np.concatenate([np.arange(0, length, STRIDE), np.arange(max(0, length - STRIDE), length)]))


def main(lengths: list[int]) -> dict:
  path = resolve_source("gemma3-270m")
  start = time.perf_counter()
  params, config = from_gguf(path)
  out = {
    "source": str(path),
    "transformers_version": transformers.__version__,
    "kvjax_import_s": round(time.perf_counter() - start, 1),
  }
  start = time.perf_counter()
  reference = transformers.AutoModelForCausalLM.from_pretrained(
    path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  out["transformers_load_s"] = round(time.perf_counter() - start, 1)
  model = kvjax.Transformer(config)
  for length in lengths:
    ids = prompt_ids(length, config.vocab_size)
    at = compared_positions(length)
    start = time.perf_counter()
    ours = np.asarray(model.apply({"params": params}, ids[None], logits_at=at[None].astype(np.int32)))[0]
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():
      theirs = reference(torch.from_numpy(ids[None].astype(np.int64)), logits_to_keep=torch.from_numpy(at)).logits[0]
    theirs = theirs.float().numpy()
    theirs_s = time.perf_counter() - start
    scale = float(np.abs(theirs).max())
    out[str(length)] = {
      "positions_compared": int(len(at)),
      "max_abs_diff": float(np.abs(ours - theirs).max()),
      "max_abs_logit": scale,
      "relative": float(np.abs(ours - theirs).max() / scale),
      "argmax_equal": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
      "kvjax_forward_s": round(ours_s, 1),
      "transformers_forward_s": round(theirs_s, 1),
    }
  ids = prompt_ids(512, config.vocab_size)
  start = time.perf_counter()
  greedy = np.asarray(kvjax.generate(model, params, ids[None], [len(ids)], 32))[0]
  out["kvjax_greedy_32_s"] = round(time.perf_counter() - start, 1)
  with torch.inference_mode():
    prompt = torch.from_numpy(ids[None].astype(np.int64))
    want = reference.generate(prompt, **hf_greedy_kwargs(torch, prompt, 32))[0, len(ids) :].numpy()
  out["greedy_32_equal"] = bool(np.array_equal(greedy, want))
  out["greedy_first_difference"] = int(np.argmax(greedy != want)) if not out["greedy_32_equal"] else None
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main([int(x) for x in sys.argv[1:]] or [512, 4096])
