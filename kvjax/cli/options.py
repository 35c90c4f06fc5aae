"""The options several commands share, defined once so that they read and parse alike everywhere.

  --set KEY=VALUE ...    config overrides, applied with kvjax.config.apply_overrides: values are
                         Python literals checked against the field's type, unknown keys are
                         refused with the valid ones listed. One --set takes several items, and
                         --set may be repeated. Commands that load a trained checkpoint
                         (generate, eval) take only model.cache_dtype (`cache_dtype`).
  --mesh data=D,model=M  a device mesh (kvjax.sharding.parse_mesh / make_mesh); the text is
                         checked when the command line is parsed, the mesh made when it is used.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jax.sharding import Mesh

from kvjax import sharding
from kvjax.config import ModelConfig
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


@dataclasses.dataclass(frozen=True)
class CheckpointSet:
  """What --set may change in a command that loads a trained checkpoint: model.cache_dtype."""

  model: ModelConfig = ModelConfig()


def cache_dtype(args: argparse.Namespace) -> str | None:
  """The model.cache_dtype that --set gives a command loading a trained checkpoint (the KV cache's
  format, the one model field a trained model may change); None when --set does not name it."""
  for item in args.overrides:
    key = item.partition("=")[0].strip()
    if key != "model.cache_dtype":
      raise ValueError(f"--set {item!r}: a trained checkpoint's config can only change model.cache_dtype")
  return apply_overrides(CheckpointSet(), args.overrides).model.cache_dtype if args.overrides else None


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
