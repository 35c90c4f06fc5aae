"""A GGUF file (llama.cpp's format), read with the `gguf` library, llama.cpp's own reader.

A GGUF holds metadata (the architecture's hyperparameters under `{arch}.*` keys, the tokenizer
under `tokenizer.*`) and named tensors, each in one of ggml's storage types. `GGUFFile` checks
the file when it opens it (a truncated or garbled file is a ValueError naming it, before any
weights are read), exposes the metadata as plain Python values and reads tensors as float32,
dequantized by `gguf.quants.dequantize` (every type the library implements: F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, the IQ types). A type the library cannot dequantize
is refused naming the tensor and its type.

Shapes: ggml lists dimensions fastest-first (ne[0] is a row's length); the reader's arrays are
in numpy order, rows first, so a 2-D weight reads as [out, in], the layout of a PyTorch
nn.Linear weight and of a Hugging Face checkpoint. `shape` reports that numpy order.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

GGUF_SUFFIX = ".gguf"


class GGUFFile:
  """The metadata and tensors of one GGUF file.

  Attributes:
    path: the file.
    metadata: {key: value} with strings, numbers, bools and lists of them (the tokenizer's
      vocabulary and merges are lists of str).
  """

  def __init__(self, path: str | pathlib.Path):
    import gguf  # a dependency of kvjax; imported here so that importing kvjax stays light

    self.path = pathlib.Path(path)
    if not self.path.is_file():
      raise ValueError(f"GGUF file {self.path} does not exist")
    try:
      reader = gguf.GGUFReader(self.path)
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors ... on a damaged file
      raise ValueError(
        f"{self.path} is not a readable GGUF file (truncated or damaged?): {type(err).__name__}: {err}"
      ) from None
    self._quants = gguf.quants
    try:
      self.metadata: dict[str, Any] = {
        key: _plain(field.contents()) for key, field in reader.fields.items() if not key.startswith("GGUF.")
      }
    except Exception as err:
      raise ValueError(f"{self.path}: cannot read its metadata (damaged?): {type(err).__name__}: {err}") from None
    self._tensors = {}
    for tensor in reader.tensors:
      if tensor.name in self._tensors:
        raise ValueError(f"{self.path} holds tensor {tensor.name} twice")
      self._tensors[tensor.name] = tensor

  @property
  def architecture(self) -> str:
    return self.require("general.architecture")

  def require(self, key: str, kind: type | tuple[type, ...] | None = None):
    """Metadata `key`, refused naming the key and the file when absent or not of `kind`."""
    if key not in self.metadata:
      raise ValueError(f"{self.path} lacks metadata key {key!r}")
    value = self.metadata[key]
    if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float)):
      raise ValueError(f"{self.path}: metadata {key}={value!r} is not of type {getattr(kind, '__name__', kind)}")
    return value

  def names(self) -> set[str]:
    return set(self._tensors)

  def where(self, name: str) -> pathlib.Path:
    return self.path

  def type_name(self, name: str) -> str:
    return self._tensors[name].tensor_type.name

  def shape(self, name: str) -> tuple[int, ...]:
    """Tensor `name`'s shape in numpy order (rows first; ggml's ne reversed)."""
    return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

  def get(self, name: str) -> np.ndarray:
    """Tensor `name` as float32 in numpy order; ValueError naming the tensor and its type when
    the gguf library cannot dequantize that type, or naming the file when the data is damaged."""
    tensor = self._tensors[name]
    try:
      values = self._quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
      raise ValueError(
        f"tensor {name} in {self.path} is stored as {tensor.tensor_type.name}, a type the gguf "
        "library cannot dequantize"
      ) from None
    except Exception as err:
      raise ValueError(
        f"cannot read tensor {name} ({tensor.tensor_type.name}) from {self.path}: {type(err).__name__}: {err}"
      ) from None
    values = np.asarray(values, np.float32)
    if values.shape != self.shape(name):
      values = values.reshape(self.shape(name))
    return values


def _plain(value):
  """A metadata value as plain Python: numpy scalars to int / float / bool, arrays to lists."""
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


def is_gguf(path: str | pathlib.Path) -> bool:
  """True for a path that names a GGUF file (by its suffix)."""
  return pathlib.Path(path).suffix.lower() == GGUF_SUFFIX
