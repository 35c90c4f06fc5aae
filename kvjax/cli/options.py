"""The options several commands share, defined once so that they read and parse alike everywhere.

  --set KEY=VALUE ...    config overrides, applied with kvjax.config.apply_overrides: values are
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
from typing import Any

from jax.sharding import Mesh

from kvjax import sharding
from kvjax.cache.config import CacheConfig
from kvjax.fields import apply_overrides

SET_HELP = ("override config fields (Python literals, checked against the field's type); several per "
            "--set, and --set repeats, e.g. --set model.num_kv_heads=2 train.steps=10")
MESH_HELP = ("shard over a device mesh of D x M devices: batch rows on data, heads / kv heads / MLP on "
             "model (an axis left out has size 1)")


def add_set_option(parser: argparse.ArgumentParser) -> None:
  """--set KEY=VALUE ..., collected in args.overrides (a list of "KEY=VALUE" strings)."""
  parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                      metavar="KEY=VALUE", help=SET_HELP)


def apply_set(config: Any, args: argparse.Namespace) -> Any:
  """`config` (a nested frozen config dataclass) with the --set overrides of `args` applied."""
  return apply_overrides(config, args.overrides)


CACHE_SET_HELP = ("the KV cache's runtime choices (kvjax.cache.config.CacheConfig), e.g. cache.dtype=int8 "
                  "cache.layout=paged cache.page_size=16 cache.window=(256,) cache.sink_tokens=4")


@dataclasses.dataclass(frozen=True)
class DecodeSet:
  """What --set may change in a command that decodes a trained checkpoint: its cache."""

  cache: CacheConfig = CacheConfig()


def add_cache_set_option(parser: argparse.ArgumentParser) -> None:
  """--set cache.KEY=VALUE ..., collected in args.overrides."""
  parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                      metavar="cache.KEY=VALUE", help=CACHE_SET_HELP)


def cache_config(args: argparse.Namespace) -> CacheConfig | None:
  """The CacheConfig that --set gives a command decoding a trained checkpoint; None when --set is
  not given. Only cache.* keys: a trained network's config is what it was trained as."""
  for item in args.overrides:
    if not item.partition("=")[0].strip().startswith("cache."):
      raise ValueError(f"--set {item!r}: a trained checkpoint is decoded as it was trained; --set takes only "
                       "the cache's runtime choices, cache.KEY=VALUE")
  return apply_overrides(DecodeSet(), args.overrides).cache if args.overrides else None


def mesh_text(text: str) -> str:
  """The argparse type of --mesh: the text unchanged once kvjax.sharding.parse_mesh accepts it."""
  try:
    sharding.parse_mesh(text)
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None
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
  return text


def positive_int(text: str) -> int:
  """The argparse type of options that count something: an integer >= 1."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value
