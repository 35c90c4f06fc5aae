"""The files of a Hugging Face model directory, each checked as it is read: config.json, the
safetensors files the checkpoint declares, and tokenizer.json.

Declared files: the shards model.safetensors.index.json's weight_map names (each tensor from the
shard it names), or, without an index, model.safetensors alone; no other *.safetensors is read,
so a stray file beside a model changes nothing. A missing, truncated or garbled file, a tensor
in another shard than the index says, or a weight that is not a float tensor is a ValueError
naming the file. tokenizer.json must load with the `tokenizers` library and its ids fit the
model's vocabulary; it travels, with the tokenizer_config.json and chat_template.jinja beside it
(special tokens, chat template: kvjax.interop.tokenizer reads them), with every kvjax workdir
derived from the model (copy_tokenizer).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
# Beside tokenizer.json: the special tokens and the chat template (transformers 4.43+ write the
# template to its own file).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# safetensors dtype codes of the weights kvjax reads (converted to float32).
FLOAT_TENSORS = ("F32", "F16", "BF16", "F64")
# Names stripped from checkpoints saved from a *ForCausalLM wrapper rather than the base model.
BASE_PREFIXES = ("model.", "transformer.")


def read_hf_config(hf_dir: str | pathlib.Path) -> dict:
  """The parsed config.json of a Hugging Face model directory."""
  path = pathlib.Path(hf_dir) / "config.json"
  if not path.is_file():
    raise ValueError(f"{hf_dir} is not a Hugging Face model directory: {path} does not exist")
  try:
    hf = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise ValueError(f"{path} is not valid JSON: {err}") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not a model config object")
  return hf


class TensorFiles:
  """The tensors a Hugging Face directory declares, read on demand.

  Declared means: the files model.safetensors.index.json's weight_map names, each tensor in the
  file the index names for it; without an index, model.safetensors alone. No other *.safetensors
  in the directory is read. Every declared file's header is checked here, so a missing, truncated
  or garbled file is a ValueError naming it before any weights are read. Names are normalised by
  dropping the base-model prefix ('model.', 'transformer.').
  """

  def __init__(self, hf_dir: str | pathlib.Path):
    root = pathlib.Path(hf_dir)
    index = root / INDEX_FILE
    declared = _read_index(root, index) if index.is_file() else None
    files = sorted(set(declared.values())) if declared is not None else [_single_file(root)]
    self.headers = {f: _read_header(f) for f in files}  # {file: {name: (dtype, shape)}}
    if declared is None:
      declared = {name: files[0] for name in self.headers[files[0]]}
    else:
      _check_index(index, declared, self.headers)
    self.files: dict[str, pathlib.Path] = {}
    self.original: dict[str, str] = {}
    for name, f in declared.items():
      short = next((name[len(p) :] for p in BASE_PREFIXES if name.startswith(p)), name)
      if short in self.original:
        raise ValueError(f"{f} holds both {self.original[short]} and {name}: one tensor under two names")
      self.files[short], self.original[short] = f, name

  def names(self) -> set[str]:
    return set(self.files)

  def where(self, name: str) -> pathlib.Path:
    """The file that holds tensor `name`."""
    return self.files[name]

  def shape(self, name: str) -> tuple[int, ...]:
    """Tensor `name`'s shape from its file's header; ValueError naming the file when it is not
    a float tensor (a weight kvjax can read)."""
    path, original = self.files[name], self.original[name]
    dtype, shape = self.headers[path][original]
    if dtype not in FLOAT_TENSORS:
      raise ValueError(
        f"tensor {original} in {path} has dtype {dtype}; kvjax reads weights stored as {', '.join(FLOAT_TENSORS)}"
      )
    return tuple(shape)

  def get(self, name: str) -> np.ndarray:
    """Tensor `name` as float32; ValueError naming its file when it is not a float tensor or
    cannot be read."""
    self.shape(name)
    path, original = self.files[name], self.original[name]
    try:
      with safe_open(path, framework="numpy") as st:
        return np.asarray(st.get_tensor(original), dtype=np.float32)
    except (SafetensorError, OSError) as err:
      raise ValueError(f"cannot read tensor {original} from {path}: {err}") from None


def _single_file(root: pathlib.Path) -> pathlib.Path:
  """model.safetensors of a directory without an index; refuses to guess among other files."""
  single = root / SINGLE_FILE
  if single.is_file():
    return single
  others = sorted(f.name for f in root.glob("*.safetensors"))
  if others:
    raise ValueError(
      f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}; kvjax reads only the files a "
      f"checkpoint declares, not whichever *.safetensors are there ({', '.join(others[:4])}"
      + (", ..." if len(others) > 4 else "")
      + ")"
    )
  raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root} (pickled .bin checkpoints are not read)")


def _read_index(root: pathlib.Path, index: pathlib.Path) -> dict[str, pathlib.Path]:
  """{tensor name: shard file} of an index; ValueError naming the index or the missing shards."""
  try:
    weight_map = json.loads(index.read_text()).get("weight_map")
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
    raise ValueError(f"{index} is not a readable safetensors index: {err}") from None
  if not isinstance(weight_map, dict) or not weight_map:
    raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files")
  located = {}
  for name, file in weight_map.items():
    parts = pathlib.PurePosixPath(file).parts if isinstance(file, str) else ()
    if not parts or parts[0] == "/" or ".." in parts:
      raise ValueError(f"{index} names shard file {file!r} for {name}, which is not a file in {root}")
    located[name] = root / file
  absent = sorted({f.name for f in located.values() if not f.is_file()})
  if absent:
    raise ValueError(f"{index} lists shard files that do not exist: {absent}")
  return located


def _read_header(path: pathlib.Path) -> dict[str, tuple[str, list[int]]]:
  """{name: (dtype, shape)} from a safetensors file's header; ValueError naming a damaged file."""
  try:
    with safe_open(path, framework="numpy") as st:
      return {name: (st.get_slice(name).get_dtype(), st.get_slice(name).get_shape()) for name in st.keys()}
  except (SafetensorError, OSError) as err:
    raise ValueError(f"{path} is not a readable safetensors file (truncated or damaged?): {err}") from None


def _check_index(index: pathlib.Path, declared: dict[str, pathlib.Path], headers: dict) -> None:
  """Every tensor sits in the shard the index names for it, and the shards hold nothing else."""
  for name, f in declared.items():
    if name not in headers[f]:
      elsewhere = [g.name for g, names in headers.items() if name in names]
      raise ValueError(
        f"{index} places tensor {name} in {f.name}, which does not hold it"
        + (f" (it is in {', '.join(elsewhere)})" if elsewhere else "")
      )
  for f, names in headers.items():
    spare = sorted(n for n in names if declared.get(n) != f)
    if spare:
      raise ValueError(
        f"{f} holds {len(spare)} tensor(s) that {index.name} does not place there: "
        f"{spare[:8]}" + (" ..." if len(spare) > 8 else "")
      )


def load_tokenizer(path: str | pathlib.Path, vocab_size: int | None = None):
  """A `tokenizers.Tokenizer` from tokenizer.json (a file or a directory holding one), or None if absent.

  Raises ValueError naming the file when it does not load, has no tokens, or (given the model's
  vocab_size) has an id, added tokens included, that the model's embedding does not hold.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / TOKENIZER_FILE
  if not path.is_file():
    return None
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise ValueError(f"{path} needs the 'tokenizers' package: pip install tokenizers") from None
  try:
    tokenizer = Tokenizer.from_file(str(path))
  except Exception as err:  # tokenizers raises plain Exceptions for every kind of bad file
    raise ValueError(f"{path} is not a valid tokenizer.json: {err}") from None
  ids = tokenizer.get_vocab(with_added_tokens=True).values()
  if not ids:
    raise ValueError(f"{path} is not a usable tokenizer.json: its vocabulary is empty")
  if vocab_size is not None and max(ids) >= vocab_size:
    raise ValueError(
      f"{path} has token ids up to {max(ids)}, past the model's vocab_size={vocab_size}; "
      "it is not this model's tokenizer"
    )
  return tokenizer


def copy_tokenizer(source: str | pathlib.Path, workdir: str | pathlib.Path) -> pathlib.Path | None:
  """Copies the tokenizer.json of directory `source` into `workdir`, with its tokenizer_config.json
  and chat_template.jinja when present (a model's tokenizer travels with every workdir derived from
  it); returns the tokenizer.json copy, or None when the source has none."""
  source, workdir = pathlib.Path(source), pathlib.Path(workdir)
  if not (source / TOKENIZER_FILE).is_file():
    return None
  for name in (TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE):
    if (source / name).is_file():
      shutil.copyfile(source / name, workdir / name)
  return pathlib.Path(shutil.copyfile(source / TOKENIZER_FILE, workdir / TOKENIZER_FILE))
