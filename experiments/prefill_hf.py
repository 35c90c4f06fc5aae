"""transformers' prefill (last logits) of random prompts in float32 and bfloat16: wall and CPU ms per
core, as JSON. Settings from the environment: MODEL, B, T (docs/kernels.md)."""

import os
import time
import json
import copy
import numpy as np
import torch
from kvjax.bench.peers.hf_model import hf_reference
from kvjax.interop.importer import resolve_source

torch.set_num_threads(2)
name = os.environ.get("MODEL", "smollm2-135m")
B = int(os.environ.get("B", 2))
T = int(os.environ.get("T", 2048))
m = hf_reference(resolve_source(name))
ids = torch.from_numpy(np.random.default_rng(0).integers(0, 40000, (B, T)))
res = {}
for dt in ("float32", "bfloat16"):
  mm = m if dt == "float32" else copy.deepcopy(m).to(torch.bfloat16)
  f = lambda: mm(ids, use_cache=True, logits_to_keep=1).logits
  with torch.inference_mode():
    f()
    w = []
    c = []
    for _ in range(2):
      s, cs = time.perf_counter(), time.process_time()
      f()
      w.append(time.perf_counter() - s)
      c.append(time.process_time() - cs)
  res[dt] = (round(min(w) * 1e3), round(min(c) * 1e3 / 2))
print(name, B, T, getattr(m.config, "_attn_implementation", None), json.dumps(res))
