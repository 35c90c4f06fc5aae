"""The options several commands share, defined once so that they read and parse alike everywhere.

--set KEY=VALUE ...    config overrides, applied with kvjax.fields.apply_overrides: values are
                       Python literals checked against the field's type, unknown keys are
                       refused with the valid ones listed. One --set takes several items, and
                       --set may be repeated. Commands that decode a trained checkpoint
                       (generate, eval) take only the cache's runtime choices, cache.*
                       (`cache_config`: cache.dtype=int8, cache.layout=paged, ...).
--mesh data=D,model=M  a device mesh (kvjax.sharding.parse_mesh / make_mesh); the text is
                       checked when the command line is parsed, the mesh made when it is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from jax.sharding import Mesh

from kvjax import sharding
from kvjax.cache.config import CacheConfig
from kvjax.fields import INT32_MAX, SEED_MAX, apply_overrides
from kvjax.model import weights

SET_HELP = (
  "override config fields (Python literals, checked against the field's type); several per "
  "--set, and --set repeats, e.g. --set model.num_kv_heads=2 train.steps=10"
)
MESH_HELP = (
  "shard over a device mesh of D x M devices: batch rows on data, heads / kv heads / MLP on "
  "model (an axis left out has size 1)"
)


def add_set_option(parser: argparse.ArgumentParser) -> None:
  """--set KEY=VALUE ..., collected in args.overrides (a list of "KEY=VALUE" strings)."""
  parser.add_argument(
    "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help=SET_HELP
  )


def apply_set(config: Any, args: argparse.Namespace) -> Any:
  """`config` (a nested frozen config dataclass) with the --set overrides of `args` applied."""
  return apply_overrides(config, args.overrides)


CACHE_SET_HELP = (
  "the KV cache's runtime choices (kvjax.cache.config.CacheConfig), e.g. cache.dtype=int8 "
  "cache.layout=paged cache.page_size=16 cache.window=(256,) cache.sink_tokens=4; a press by "
  "name, then its fields: cache.press=snapkv cache.press.compression_ratio=0.75 "
  "cache.press.window=32 (kvjax.cache.presses); and the weights' format, "
  "weights=float32|bfloat16|int8 (kvjax.model.weights)"
)


@dataclasses.dataclass(frozen=True)
class DecodeSet:
  """What --set may change in a command that decodes a trained checkpoint: its cache, and the
  format its weights are decoded in (kvjax.model.weights.FORMATS)."""

  cache: CacheConfig = CacheConfig()
  weights: str = "float32"

  def __post_init__(self):
    weights.check_format(self.weights)


def add_cache_set_option(parser: argparse.ArgumentParser) -> None:
  """--set cache.KEY=VALUE ..., collected in args.overrides."""
  parser.add_argument(
    "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="cache.KEY=VALUE", help=CACHE_SET_HELP
  )


def decode_set(args: argparse.Namespace) -> DecodeSet:
  """The runtime choices --set gives a command decoding a trained checkpoint. Only cache.* keys
  and weights: a trained network's config is what it was trained as."""
  for item in args.overrides:
    key = item.partition("=")[0].strip()
    if not (key.startswith("cache.") or key == "weights"):
      raise ValueError(
        f"--set {item!r}: a trained checkpoint is decoded as it was trained; --set takes only "
        "the runtime choices, cache.KEY=VALUE and weights=FORMAT"
      )
  return apply_overrides(DecodeSet(), args.overrides)


def cache_config(args: argparse.Namespace) -> CacheConfig | None:
  """The CacheConfig that --set gives a command decoding a trained checkpoint; None when --set is
  not given."""
  return decode_set(args).cache if args.overrides else None


def mesh_text(text: str) -> str:
  """The argparse type of --mesh: the text unchanged once kvjax.sharding.parse_mesh accepts it and
  it names each axis it sizes once (an empty --mesh is a mistake, not a mesh of one device)."""
  try:
    sharding.parse_mesh(text)
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None
  axes = [item.partition("=")[0].strip() for item in text.split(",") if item.strip()]
  if not axes:
    raise argparse.ArgumentTypeError(f"must size at least one axis, e.g. data=2 or data=2,model=4, got {text!r}")
  if len(set(axes)) < len(axes):
    raise argparse.ArgumentTypeError(f"sizes an axis twice: {text!r}")
  return text


def add_mesh_option(parser: argparse.ArgumentParser) -> None:
  """--mesh data=D,model=M, kept as text in args.mesh (None when not given)."""
  parser.add_argument("--mesh", type=mesh_text, metavar="data=D,model=M", help=MESH_HELP)


def mesh(args: argparse.Namespace) -> Mesh | None:
  """The --mesh of `args` as a Mesh over this machine's devices; None (no sharding) without one."""
  return sharding.mesh_from_spec(args.mesh)


def workdir_text(text: str) -> str:
  """The argparse type of --workdir: a path that names a directory (an empty one would be the
  current directory)."""
  if not text.strip():
    raise argparse.ArgumentTypeError("must name a directory; an empty path would be the current directory")
  return _path(text)


def path_text(text: str) -> str:
  """The argparse type of an argument naming a file or folder (or a name the command knows)."""
  if not text.strip():
    raise argparse.ArgumentTypeError("must name a file or folder, got an empty path")
  return _path(text)


def program_path(text: str) -> str:
  """The argparse type of an argument naming a program to run: an existing executable file."""
  path = path_text(text)
  if not (os.path.isfile(path) and os.access(path, os.X_OK)):
    raise argparse.ArgumentTypeError(f"{path} is not an executable file")
  return path


def nonempty_text(text: str) -> str:
  """The argparse type of a name (a dtype, a method): not empty, which would read as the default."""
  if not text.strip():
    raise argparse.ArgumentTypeError("must not be empty")
  return text


def _path(text: str) -> str:
  """`text`, checked to be a path this system's file names can hold."""
  if "\x00" in text:
    raise argparse.ArgumentTypeError(f"{text!r} is not a path: it holds a NUL character")
  try:
    os.fsencode(text)
  except UnicodeEncodeError:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not a path: file names here are {sys.getfilesystemencoding()}, which cannot hold it"
    ) from None
  return text


def _int(text: str, low: int, high: int, what: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
  if not low <= value <= high:
    raise argparse.ArgumentTypeError(
      f"must be {what} up to {high:,}, got {text}" if value > high else f"must be {what}, got {text}"
    )
  return value


def positive_int(text: str) -> int:
  """The argparse type of options that count something: an integer >= 1 that JAX can index with
  (at most kvjax.fields.INT32_MAX)."""
  return _int(text, 1, INT32_MAX, "a positive integer")


def nonnegative_int(text: str) -> int:
  """The argparse type of options where 0 means none or the default: an integer in [0, INT32_MAX]."""
  return _int(text, 0, INT32_MAX, "a non-negative integer")


def seed(text: str) -> int:
  """The argparse type of --seed: an integer in [0, kvjax.fields.SEED_MAX] (jax.random.key's range)."""
  return _int(text, 0, SEED_MAX, "a non-negative integer")


def port(text: str) -> int:
  """The argparse type of --port: a TCP port, 1 to 65,535."""
  return _int(text, 1, 65535, "a TCP port from 1")
