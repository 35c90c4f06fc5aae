"""transformers' perplexity on the KV frontier's windows of a pretrained model, the reference for
its full-cache row: the same held-out prose windows (kvjax.studies.parts.real_kv.prose_windows), the
second half of each scored after the first (as kvjax.studies.base.measure.perplexity reads them
through a cache), float32 from the same file. Prints JSON.

  python experiments/real_reference.py configs/kv_frontier/smollm2.py
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import torch
import transformers

from kvjax.bench.peers.hf_model import hf_reference
from kvjax.cli.run import load_config
from kvjax.interop.importer import read_model
from kvjax.studies.parts.real_kv import prose_windows


def main(config_path: str) -> dict:
  study = load_config(config_path)
  _, _, tokenizer, path = read_model(study.source)
  model = hf_reference(path)
  out = {"source": str(path), "transformers_version": transformers.__version__}
  for length in study.measure.contexts:
    total = count = 0.0
    for inputs, targets in prose_windows(tokenizer, length, study.measure.windows):
      half = length // 2
      with torch.inference_mode():
        logits = model(torch.from_numpy(inputs.astype(np.int64))).logits.float()[:, half:]
      scored = torch.from_numpy(targets[:, half:].astype(np.int64))
      total += float(
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), scored.reshape(-1), reduction="sum")
      )
      count += scored.numel()
    out[f"perplexity_{length}"] = math.exp(total / count)
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main(sys.argv[1])
