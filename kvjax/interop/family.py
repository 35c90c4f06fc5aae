"""What a model family is: a `Family` entry (how its config maps to ModelConfig and back) and the
`Tensor`s it lists (which checkpoint tensor becomes which kvjax parameter, and how it is laid
out), with the helpers entries share; import and export both read only these.

The families themselves are one module each (kvjax.interop.llama, qwen2, gpt2), listed in
kvjax.interop.families.FAMILIES.

Layouts (source -> kvjax; D model dim, N query heads, K kv heads, H head dim), each a `Tensor`'s
rows / linear / part fields, read one way on import and the other on export:
  nn.Linear weight [out, in] (a GGUF 2-D tensor reads the same way) -> Dense kernel [in, out]
  q [N*H, D], k/v [K*H, D] -> q kernel [D, N, H], k/v kernel [D, K, H]; o [D, N*H] -> [N, H, D]
  GPT-2's Conv1D c_attn [D, 3*N*H] ([in, out] already) -> q, k, v kernels [D, N, H], its thirds
Query head n reads kv head n // G in HF's repeat_kv as in kvjax (`kv_head_of`): heads map one to one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from kvjax.config import ModelConfig
from kvjax.interop.gguf_file import GGUFFile

HF, GGUF = "hf", "gguf"
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One kvjax parameter and where each format keeps it, in a layout both directions read: import
  (`read`) and export (`checkpoint_shape`, `write`) follow the same fields, so one undoes the other.

  path: the kvjax parameter, e.g. ("layers_0", "attn", "q", "kernel").
  hf, gguf: the tensor's name in a safetensors checkpoint (without the base-model prefix, see
    `Family.hf_name`) and in a GGUF file; None where that format cannot hold it.
  rows: the checkpoint holds a matrix whose rows are the kvjax array's first `rows` axes and whose
    columns are the rest, [in, out] as a Dense kernel or Conv1D stores it (q kernel [D, N, H] with
    rows=1 -> [D, N*H]; out kernel [N, H, D] with rows=2 -> [N*H, D]); None: the kvjax array
    flattened to 1-D (a bias [N, H] -> [N*H], a norm scale).
  linear: the matrix is stored transposed, [out, in] (nn.Linear, and every GGUF matrix).
  part: (j, n): the tensor is the j-th of n equal blocks along the matrix's out axis (GPT-2's
    fused c_attn holds q, k and v side by side); several kvjax parameters share its name.
  gguf_fix: applied to the GGUF array before the rest (llama.cpp's row permutation); GGUF is
    read, not written.
  when: a config.json flag saying whether the checkpoint holds the tensor (Llama's attention_bias,
    mlp_bias): import takes zeros where it is absent (GGUF has no such flags), export writes it
    where the family's config.json sets the flag.
  """

  path: tuple[str, ...]
  hf: str | None
  gguf: str | None
  rows: int | None = None
  linear: bool = False
  part: tuple[int, int] | None = None
  gguf_fix: Callable[[np.ndarray], np.ndarray] | None = None
  when: str | None = None

  def name(self, source: str) -> str | None:
    return self.hf if source == HF else self.gguf

  def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The kvjax array of `shape` as the checkpoint lays it out, [in, out] (or 1-D), this part alone."""
    if self.rows is None:
      return (math.prod(shape),)
    return (math.prod(shape[: self.rows]), math.prod(shape[self.rows :]))

  def checkpoint_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the checkpoint tensor that holds the kvjax parameter of `shape` (all its parts)."""
    matrix = self.matrix_shape(shape)
    if self.part is not None:
      matrix = (*matrix[:-1], matrix[-1] * self.part[1])
    return matrix[::-1] if self.linear else matrix

  def read(self, source: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The kvjax parameter of `shape` from the checkpoint tensor `array` of `checkpoint_shape(shape)`."""
    if source == GGUF and self.gguf_fix is not None:
      array = self.gguf_fix(array)
    if self.linear:
      array = array.T  # [in, out]
    if self.part is not None:
      j, n = self.part
      width = array.shape[-1] // n
      array = array[..., j * width : (j + 1) * width]
    return array.reshape(shape)


def write(parts: list[tuple[Tensor, np.ndarray]]) -> np.ndarray:
  """The safetensors tensor that holds `parts` (each a Tensor of one name and its kvjax value):
  `Tensor.read` undone, the parts of a fused tensor joined in their order."""
  parts = sorted(parts, key=lambda item: item[0].part[0] if item[0].part else 0)
  first = parts[0][0]
  if len(parts) != (first.part[1] if first.part else 1):
    raise AssertionError(f"{first.hf} is written from {len(parts)} parts, not {first.part}")
  matrix = np.concatenate([np.asarray(v).reshape(t.matrix_shape(np.shape(v))) for t, v in parts], axis=-1)
  return matrix.T if first.linear else matrix


@dataclasses.dataclass(frozen=True)
class Family:
  """How one architecture maps onto kvjax, both ways.

  hf_model_types, gguf_architectures: the config.json model_type and GGUF general.architecture
  values that pick this entry (none: not read from GGUF); export writes the first model_type.
  config_from_hf(config.json dict, dtype) and config_from_gguf(GGUFFile, dtype) -> ModelConfig,
  each refusing, by name, a key that is missing, contradictory or asks for what kvjax lacks;
  config_to_hf(ModelConfig, params) -> the family's config.json keys (its inverse; params say
  which optional biases are nonzero). kvjax.interop.hf_export reads the keys back through
  config_from_hf, so what the family cannot hold shows as a field that comes back different.
  tensors(config, names in the checkpoint) -> the Tensor of every kvjax parameter.
  hf_architecture: the transformers class that loads an export (config.json's architectures).
  hf_prefix: the base model's prefix of safetensors names ('model.', 'transformer.').
  """

  name: str
  hf_model_types: tuple[str, ...]
  gguf_architectures: tuple[str, ...]
  config_from_hf: Callable[[dict, str], ModelConfig]
  config_from_gguf: Callable[[GGUFFile, str], ModelConfig] | None
  tensors: Callable[[ModelConfig, set[str]], list[Tensor]]
  config_to_hf: Callable[[ModelConfig, dict], dict]
  hf_architecture: str
  hf_prefix: str

  def hf_name(self, name: str) -> str:
    """The safetensors name transformers saves for plan name `name`: the base model's tensors
    under hf_prefix, the LM head (outside the base model) as it is."""
    return name if name.startswith("lm_head.") else self.hf_prefix + name


def nonzero(params: dict, paths) -> bool:
  """Whether any of the parameters at `paths` (tuples into the params tree) is nonzero; one the
  model does not have counts as zero (a GPT-2 shaped model has no gate bias)."""

  def at(path):
    tree = params
    for key in path:
      tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    return 0 if isinstance(tree, dict) else tree

  return any(np.any(np.asarray(at(path))) for path in paths)


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


def gguf_rope_fields(f: GGUFFile, dtype: str) -> dict:
  """The ModelConfig fields every llama-like GGUF gives the same way (kv heads, MLP width, RMSNorm
  epsilon, RoPE positions, tied embeddings, context length, dtype); a family adds the rest."""
  key = lambda name: f"{f.architecture}.{name}"
  return dict(
    num_kv_heads=gguf_int(f, key("attention.head_count_kv"), gguf_int(f, key("attention.head_count"))),
    mlp_dim=gguf_int(f, key("feed_forward_length")),
    norm="rmsnorm",
    norm_eps=float(f.require(key("attention.layer_norm_rms_epsilon"), (float, int))),
    positions="rope",
    tie_embeddings="output.weight" not in f.names(),
    max_len=gguf_int(f, key("context_length")),
    dtype=dtype,
  )
