"""NVIDIA kvpress on the eviction study's needles (kvjax.studies.eviction), the reference that
kvjax's presses are compared with in docs/results.md: the same prompts, token for token, through
`transformers` (float32, from the same GGUF file) with kvpress's presses as context managers.

Needs kvpress (`pip install kvpress`; not a kvjax dependency). Run:
  python experiments/kvpress_reference.py [ratio] [trials] [protocols] > kvpress_reference.json
"""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np

from kvjax.bench.real_model import hf_reference
from kvjax.interop.importer import read_model
from kvjax.studies.eviction import PROTOCOLS, EvictionStudy, needles
from kvjax.studies.scoring import score


def presses(kvpress, ratio: float) -> dict:
  return {
    "full cache": None,
    "streaming_llm": kvpress.StreamingLLMPress(compression_ratio=ratio),
    "snapkv": kvpress.SnapKVPress(compression_ratio=ratio),
    "tova": kvpress.TOVAPress(compression_ratio=ratio),
    "knorm": kvpress.KnormPress(compression_ratio=ratio),
    "random": kvpress.RandomPress(compression_ratio=ratio, seed=0),
  }


def greedy(
  torch, transformers, hf, press, pressed: np.ndarray, after: np.ndarray, new_tokens: int, stop_ids
) -> list[int]:
  """Prefill `pressed` under the press, then read `after` and decode greedily, one token per
  call at its own position (a pressed cache holds fewer entries than the positions it covers)."""
  cache = transformers.DynamicCache()
  with torch.inference_mode():
    with press(hf) if press is not None else contextlib.nullcontext():
      out = hf(input_ids=torch.from_numpy(pressed[None].astype(np.int64)), cache=cache, use_cache=True)
    position = len(pressed)

    def feed(token: int):
      nonlocal position
      result = hf(
        input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=cache, use_cache=True
      )
      position += 1
      return result

    for token in after:
      out = feed(int(token))
    tokens = []
    for _ in range(new_tokens):
      token = int(out.logits[0, -1].argmax())
      if token in stop_ids:
        break
      tokens.append(token)
      out = feed(token)
  return tokens


def main(ratio: float = 0.75, trials: int = 24, protocols: tuple[str, ...] = PROTOCOLS) -> dict:
  import kvpress
  import torch
  import transformers

  params, config, tokenizer, path = read_model("smollm2-135m")
  del params
  hf = hf_reference(path)
  study = EvictionStudy(trials=trials)
  contexts, question, samples = needles(tokenizer, study)
  result = {"kvpress_version": getattr(kvpress, "__version__", "?"), "transformers_version": transformers.__version__}
  for name, press in presses(kvpress, ratio).items():
    for protocol in protocols:
      hits = []
      for context, sample in zip(contexts, samples):
        budget = sample["answer_tokens"]
        if protocol == "query_agnostic":
          answer = greedy(torch, transformers, hf, press, context, question, budget, tokenizer.stop_ids)
        else:
          prompt = np.concatenate([context, question])
          answer = greedy(torch, transformers, hf, press, prompt, question[:0], budget, tokenizer.stop_ids)
        hits.append(score(tokenizer.decode(np.asarray(answer, np.int32)), sample["references"]))
      result[f"{name} {protocol}"] = 100.0 * float(np.mean(hits))
      print(json.dumps({name: {protocol: result[f"{name} {protocol}"]}}), file=sys.stderr)
  return result


if __name__ == "__main__":
  args = sys.argv[1:]
  ratio = float(args[0]) if args else 0.75
  trials = int(args[1]) if len(args) > 1 else 24
  protocols = tuple(args[2].split(",")) if len(args) > 2 else PROTOCOLS
  print(json.dumps(main(ratio, trials, protocols)))
