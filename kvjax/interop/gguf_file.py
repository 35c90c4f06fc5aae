"""A GGUF file (llama.cpp's format), read with the `gguf` library's types and dequantizers.

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

The header (metadata and tensor index) is read here, in one pass over the file's bytes, the way
`gguf.GGUFReader` reads it, to the same values (tests/interop/test_gguf_header.py checks both
real models and a file of every value type against the reader): that reader makes a numpy view
per element of every array, 11 s for Gemma 3's 262,144-token vocabulary where this pass takes
well under a second. A file this pass does not take (the other byte order, a version it does not
know, arrays of arrays) is read by `gguf.GGUFReader` itself.
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
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
    self._quants = gguf.quants
    try:
      self.metadata, tensors = read_header(self.path)
    except _Unsupported:
      self.metadata, tensors = _read_with_gguf(self.path)
    except Exception as err:  # struct errors, bad UTF-8, sizes past the end ... on a damaged file
      raise ValueError(
        f"{self.path} is not a readable GGUF file (truncated or damaged?): {type(err).__name__}: {err}"
      ) from None
    self._tensors = {}
    for tensor in tensors:
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


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a GGUF file, as gguf.GGUFReader gives it: its ggml type, its ne (ggml's
  dimensions, fastest first) and its data, a read-only view of the file (typed for the float and
  integer types, bytes in the type's byte shape for the block-quantized ones)."""

  name: str
  tensor_type: Any  # gguf.GGMLQuantizationType
  shape: np.ndarray
  data: np.ndarray


class _Unsupported(Exception):
  """A valid GGUF file that read_header leaves to gguf.GGUFReader."""


def read_header(path: str | pathlib.Path) -> tuple[dict[str, Any], list[Tensor]]:
  """The metadata ({key: plain value}) and tensors of the little-endian GGUF file at `path`, as
  gguf.GGUFReader reads them; _Unsupported for what it leaves to that reader, struct.error,
  UnicodeDecodeError or ValueError for a damaged file."""
  import gguf

  data = np.memmap(path, mode="r")
  buf = memoryview(data)
  pos = 0

  def take(fmt: str):
    nonlocal pos
    values = struct.unpack_from(fmt, buf, pos)
    pos += struct.calcsize(fmt)
    return values if len(values) > 1 else values[0]

  def string() -> str:
    nonlocal pos
    size = take("<Q")
    if pos + size > len(buf):
      raise ValueError(f"a string of {size} bytes runs past the end of the file")
    pos += size
    return str(buf[pos - size : pos], "utf-8")

  def numbers(dtype, count: int) -> np.ndarray:
    nonlocal pos
    dtype = np.dtype(dtype)
    if pos + dtype.itemsize * count > len(buf):
      raise ValueError(f"{count} values of {dtype} run past the end of the file")
    pos += dtype.itemsize * count
    return np.frombuffer(buf, dtype, count, pos - dtype.itemsize * count)

  types = gguf.GGUFValueType
  scalars = {
    types.UINT8: "<u1",
    types.INT8: "<i1",
    types.UINT16: "<u2",
    types.INT16: "<i2",
    types.UINT32: "<u4",
    types.INT32: "<i4",
    types.FLOAT32: "<f4",
    types.BOOL: "?",
    types.UINT64: "<u8",
    types.INT64: "<i8",
    types.FLOAT64: "<f8",
  }

  def value(kind: int):
    if kind == types.STRING:
      return string()
    if kind in scalars:
      return numbers(scalars[kind], 1)[0].item()
    if kind != types.ARRAY:
      raise ValueError(f"unknown metadata value type {kind}")
    item, count = take("<I"), take("<Q")
    if item == types.STRING:
      return [string() for _ in range(count)]
    if item not in scalars:
      raise _Unsupported(f"arrays of type {item}")
    return numbers(scalars[item], count).tolist()

  if take("<I") != gguf.GGUF_MAGIC:
    raise ValueError("GGUF magic invalid")
  version = take("<I")
  if version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
    raise _Unsupported(f"version {version}")
  tensor_count, kv_count = take("<QQ")
  metadata: dict[str, Any] = {}
  for _ in range(kv_count):
    key = string()
    metadata[key] = value(take("<I"))
  index = []
  for _ in range(tensor_count):
    name = string()
    dims = numbers("<u8", take("<I")).copy()
    kind, offset = take("<IQ")
    index.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
  alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
  if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
    raise ValueError(f"general.alignment={alignment!r} is not a power of two")
  start = -(-pos // alignment) * alignment
  typed = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
  typed |= {"I32": np.int32, "I64": np.int64}
  tensors = []
  for name, dims, kind, offset in index:
    elements = int(np.prod(dims))
    block, size = gguf.GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(dims.tolist()))
    if kind.name in typed:
      dtype, count = np.dtype(typed[kind.name]), elements
    else:
      dtype, count, shape = np.dtype(np.uint8), elements * size // block, gguf.quant_shape_to_byte_shape(shape, kind)
    begin = start + offset
    if begin + count * dtype.itemsize > len(data):
      raise ValueError(f"tensor {name}'s data runs past the end of the file")
    tensors.append(Tensor(name, kind, dims, data[begin : begin + count * dtype.itemsize].view(dtype).reshape(shape)))
  return metadata, tensors


def _read_with_gguf(path: pathlib.Path) -> tuple[dict[str, Any], list]:
  """What read_header gives, read by gguf.GGUFReader (every file it takes, slowly)."""
  import gguf

  reader = gguf.GGUFReader(path)
  metadata = {key: _plain(field.contents()) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
  return metadata, reader.tensors


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
