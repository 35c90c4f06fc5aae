"""The Qwen2 family: the llama-like core (kvjax.interop.llama) with q/k/v biases and no output or
MLP ones; tied embeddings on the small sizes. llama.cpp leaves its q / k rows unpermuted (it
rotates them NeoX-style, as HF does)."""

from __future__ import annotations

import functools

from kvjax.config import ModelConfig
from kvjax.interop import llama
from kvjax.interop.family import Family
from kvjax.interop.gguf_file import GGUFFile


def _hf_biases(hf: dict) -> tuple[bool, bool]:
  """Qwen2 always has q/k/v biases and nothing else; its sliding window is refused."""
  sliding = hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ())
  if sliding:
    raise ValueError("config.json enables sliding-window attention, which kvjax does not support")
  return True, False


def _hf_biases_to(config: ModelConfig, params: dict) -> dict:
  """No keys: Qwen2's biases are fixed (export refuses nonzero output or MLP biases, which it lacks)."""
  return {}


def _gguf_biases(f: GGUFFile) -> tuple[bool, bool]:
  return True, False


QWEN2 = Family(
  "qwen2",
  ("qwen2",),
  ("qwen2",),
  functools.partial(llama.hf_config, biases=_hf_biases),
  functools.partial(llama.gguf_config, biases=_gguf_biases),
  functools.partial(llama.tensors, gguf_permuted=False),
  functools.partial(llama.to_hf_config, biases=_hf_biases_to),
  "Qwen2ForCausalLM",
  "model.",
)
