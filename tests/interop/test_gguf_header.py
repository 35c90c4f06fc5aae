"""kvjax's one-pass GGUF header reader (kvjax.interop.gguf_file.read_header) against the gguf
library's own reader: the same metadata and the same tensors (type, ne, data) for a file of every
value type and tensor type gguf writes, for SmolLM2's GGUF and (second tier) Gemma 3's; a file it
leaves to the library is read by it; a damaged one is refused naming the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvjax.interop import gguf_file
from kvjax.interop.importer import resolve_source


def same_as_gguf(path) -> None:
  metadata, tensors = gguf_file.read_header(path)
  want_metadata, want_tensors = gguf_file._read_with_gguf(path)
  assert metadata == want_metadata
  assert [type(v) for v in metadata.values()] == [type(v) for v in want_metadata.values()]
  assert len(tensors) == len(want_tensors)
  for got, want in zip(tensors, want_tensors):
    assert (got.name, got.tensor_type, got.shape.tolist()) == (want.name, want.tensor_type, want.shape.tolist())
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
    np.testing.assert_array_equal(got.data, want.data)


def every_type(path, alignment: int | None = None) -> None:
  rng = np.random.default_rng(0)
  writer = gguf.GGUFWriter(str(path), "llama")
  if alignment is not None:
    writer.add_custom_alignment(alignment)
  for name, value, kind in [
    ("u8", 200, gguf.GGUFValueType.UINT8),
    ("i8", -100, gguf.GGUFValueType.INT8),
    ("u16", 60000, gguf.GGUFValueType.UINT16),
    ("i16", -30000, gguf.GGUFValueType.INT16),
    ("u32", 4_000_000_000, gguf.GGUFValueType.UINT32),
    ("i32", -2_000_000_000, gguf.GGUFValueType.INT32),
    ("f32", 0.1, gguf.GGUFValueType.FLOAT32),
    ("bool", True, gguf.GGUFValueType.BOOL),
    ("u64", 2**63 + 5, gguf.GGUFValueType.UINT64),
    ("i64", -(2**62), gguf.GGUFValueType.INT64),
    ("f64", 0.1, gguf.GGUFValueType.FLOAT64),
    ("text", "naïve ✓", gguf.GGUFValueType.STRING),
  ]:
    writer.add_key_value(f"test.{name}", value, kind)
  writer.add_array("test.strings", ["", "a", "ünï", "<|im_end|>"])
  writer.add_array("test.floats", [0.5, -1.25, 3e-8])
  writer.add_array("test.ints", [1, -2, 3])
  writer.add_array("test.bools", [True, False])
  writer.add_array("test.empty", [])
  writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
  writer.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
  writer.add_tensor("i32", rng.integers(-9, 9, (7,)).astype(np.int32))
  q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
  writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  bf16 = gguf.quants.quantize(rng.standard_normal((2, 8)).astype(np.float32), gguf.GGMLQuantizationType.BF16)
  writer.add_tensor("bf16", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path, alignment):
  every_type(tmp_path / "every.gguf", alignment)
  same_as_gguf(tmp_path / "every.gguf")
  file = gguf_file.GGUFFile(tmp_path / "every.gguf")
  assert file.metadata["test.u64"] == 2**63 + 5 and file.metadata["test.strings"][2] == "ünï"
  np.testing.assert_array_equal(file.get("q8"), gguf.quants.dequantize(file._tensors["q8"].data, 8))


def test_smollm2_reads_as_gguf_reads_it():
  same_as_gguf(resolve_source("smollm2-135m"))


@pytest.mark.tier2  # the library's reader takes 11 s over Gemma 3's vocabulary
def test_gemma3_reads_as_gguf_reads_it():
  same_as_gguf(resolve_source("gemma3-270m"))


def test_arrays_of_arrays_are_left_to_the_gguf_reader(tmp_path):
  writer = gguf.GGUFWriter(str(tmp_path / "nested.gguf"), "llama")
  writer.add_array("test.nested", [[1, 2], [3, 4]])
  writer.add_tensor("f32", np.ones((2, 2), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(gguf_file._Unsupported):
    gguf_file.read_header(tmp_path / "nested.gguf")
  file = gguf_file.GGUFFile(tmp_path / "nested.gguf")
  assert file.metadata["test.nested"] == gguf_file._read_with_gguf(tmp_path / "nested.gguf")[0]["test.nested"]
  np.testing.assert_array_equal(file.get("f32"), np.ones((2, 2)))


@pytest.mark.parametrize("keep", [3, 30, 200, -8])
def test_a_truncated_file_is_refused_naming_it(tmp_path, keep):
  every_type(tmp_path / "every.gguf")
  whole = (tmp_path / "every.gguf").read_bytes()
  (tmp_path / "cut.gguf").write_bytes(whole[:keep])
  with pytest.raises(ValueError, match=f"{tmp_path / 'cut.gguf'} is not a readable GGUF file"):
    gguf_file.GGUFFile(tmp_path / "cut.gguf")
