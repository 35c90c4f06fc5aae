"""A pretrained model in kvjax and in `transformers`, side by side: what the benchmarks comparing
them share (`kvjax bench hf --model NAME`, `perplexity`, `real`).

Both sides load the same file: kvjax through kvjax.interop.importer (a named model, a GGUF file or
a Hugging Face directory), `transformers` through its own loader of that file (its GGUF loader
for a .gguf, which dequantizes with the gguf library as kvjax does). Both compute in float32.
"""

from __future__ import annotations

import numpy as np

from kvjax.interop.gguf_file import is_gguf
from kvjax.interop.importer import read_config, read_model, resolve_source
from kvjax.model.transformer import Transformer
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset


def import_torch():
  """(torch, transformers), or a ValueError naming the `bench` extra that installs them."""
  try:
    import torch
    import transformers
  except ImportError as err:
    raise ValueError(f"comparing with transformers needs the bench extra (pip install 'kvjax[bench]'): {err}") from None
  return torch, transformers


def check_source(source: str) -> None:
  """Refuses, before anything is loaded, a source that read_model cannot read: neither a named model
  nor an existing path, a file that is not a GGUF, a model whose metadata or config.json is not
  one kvjax imports (only the metadata is read)."""
  path = resolve_source(source)
  if path.is_file() and not is_gguf(path):
    raise ValueError(f"{path} is a file but not a .gguf; give a GGUF file or a Hugging Face model directory")
  read_config(path)


def hf_reference(path):
  """The transformers model (float32, eval mode) of the file kvjax imported from `path`."""
  torch, transformers = import_torch()
  kwargs = {"gguf_file": path.name} if path.is_file() else {}
  folder = path.parent if path.is_file() else path
  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def hf_greedy_kwargs(torch, input_ids, new_tokens: int) -> dict:
  """transformers' generate arguments for exactly `new_tokens` greedy tokens per row of
  input_ids (no padding, no stop token), with its static cache: as kvjax's generate runs."""
  return dict(
    attention_mask=torch.ones_like(input_ids),
    max_new_tokens=new_tokens,
    min_new_tokens=new_tokens,
    do_sample=False,
    cache_implementation="static",
    pad_token_id=0,
    eos_token_id=None,
  )


def load_both(source: str):
  """(kvjax model, params, tokenizer, transformers model, versions) of one pretrained model."""
  torch, transformers = import_torch()
  params, config, tokenizer, path = read_model(source)
  if tokenizer is None:
    raise ValueError(f"{source} has no tokenizer; the real-model benchmarks need one")
  versions = {
    "transformers_version": transformers.__version__,
    "torch_version": torch.__version__,
    "torch_threads": torch.get_num_threads(),
    "source": str(path),
  }
  return Transformer(config), params, tokenizer, hf_reference(path), versions


def prose_prompts(tokenizer, batch: int, prompt: int) -> np.ndarray:
  """int32 [batch, prompt]: windows of held-out prose, so decoding runs on text it could meet."""
  data = load_dataset(DataConfig(source=PROSE, seq_len=prompt), tokenizer)
  return next(eval_batches(data.val, prompt, batch, 1))[0]


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
