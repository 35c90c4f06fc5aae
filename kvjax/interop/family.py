"""What a model family is: a `Family` entry (how its config maps to ModelConfig) and the `Tensor`s
it lists (which checkpoint tensor becomes which kvjax parameter), with the helpers entries share.

The families themselves are one module each (kvjax.interop.llama, qwen2, gpt2), listed in
kvjax.interop.families.FAMILIES.

Layouts (source -> kvjax; D model dim, N query heads, K kv heads, H head dim):
  nn.Linear weight [out, in] (a GGUF 2-D tensor reads the same way) -> Dense kernel [in, out]
  q [N*H, D], k/v [K*H, D] -> q kernel [D, N, H], k/v kernel [D, K, H]; o [D, N*H] -> [N, H, D]
Query head n reads kv head n // G in HF's repeat_kv as in kvjax (`kv_head_of`): heads map one to one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from kvjax.config import ModelConfig
from kvjax.interop.gguf_file import GGUFFile

HF, GGUF = "hf", "gguf"
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One kvjax parameter and where each format keeps it.

  path: the kvjax parameter, e.g. ("layers_0", "attn", "q", "kernel").
  hf, gguf: the tensor's name in a safetensors checkpoint (without the 'model.' prefix) and in a
    GGUF file; None where that format cannot hold it.
  convert: [out, in]-layout source array -> the kvjax array.
  gguf_fix: applied to the GGUF array before `convert` (llama.cpp's row permutation).
  optional: absent from a checkpoint means zeros (a bias the family may or may not have).
  """

  path: tuple[str, ...]
  hf: str | None
  gguf: str | None
  convert: Callable[[np.ndarray], np.ndarray] = lambda w: w
  gguf_fix: Callable[[np.ndarray], np.ndarray] | None = None
  optional: bool = False

  def name(self, source: str) -> str | None:
    return self.hf if source == HF else self.gguf

  def read(self, source: str, array: np.ndarray) -> np.ndarray:
    if source == GGUF and self.gguf_fix is not None:
      array = self.gguf_fix(array)
    return self.convert(array)


@dataclasses.dataclass(frozen=True)
class Family:
  """How one architecture maps onto kvjax.

  hf_model_types, gguf_architectures: the config.json model_type and GGUF general.architecture
  values that pick this entry (none: not read from GGUF).
  config_from_hf(config.json dict, dtype) and config_from_gguf(GGUFFile, dtype) -> ModelConfig,
  each refusing, by name, a key that is missing, contradictory or asks for what kvjax lacks;
  tensors(config, names in the checkpoint) -> the Tensor of every kvjax parameter.
  """

  name: str
  hf_model_types: tuple[str, ...]
  gguf_architectures: tuple[str, ...]
  config_from_hf: Callable[[dict, str], ModelConfig]
  config_from_gguf: Callable[[GGUFFile, str], ModelConfig] | None
  tensors: Callable[[ModelConfig, set[str]], list[Tensor]]


def require(hf: dict, *keys: str) -> list[Any]:
  """The values of config.json `keys`; ValueError naming the missing ones."""
  missing = [k for k in keys if hf.get(k) is None]
  if missing:
    raise ValueError(f"config.json of model_type {hf.get('model_type')!r} lacks {missing}")
  return [hf[k] for k in keys]


def gguf_int(f: GGUFFile, key: str, default: int | None = None) -> int:
  """The positive integer GGUF metadata `key` (or `default` where it is absent and one is given);
  ValueError naming a missing key, a per-layer list or a value that is not a positive integer."""
  if default is not None and key not in f.metadata:
    return default
  value = f.require(key)
  if isinstance(value, list):
    raise ValueError(
      f"{f.path}: metadata {key} gives one value per layer ({value[:4]}...); kvjax needs one value for every layer"
    )
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{f.path}: metadata {key}={value!r} is not a positive integer")
  return value
