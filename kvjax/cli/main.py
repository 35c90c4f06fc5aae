"""The `kvjax` command line: one subcommand per module of kvjax.cli.

Every module in COMMANDS provides `add_parser(subparsers)`, which registers its subcommand and
sets `func` on it, and `command(args)`, that `func`; `main` dispatches to it. Options that several
commands take (--set, --mesh) are defined once, in kvjax.cli.options.
"""

from __future__ import annotations

import argparse
import sys

from kvjax import sharding
from kvjax.cli import bench, build_kernels, evaluate, generate, import_hf, kv_size, run, uptrain

COMMANDS = (run, evaluate, generate, uptrain, import_hf, kv_size, bench, build_kernels)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="kvjax", description="kvjax: KV-cache-efficient decoding for decoder-only transformers in JAX/Flax.")
  subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for module in COMMANDS:
    module.add_parser(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    sharding.initialize_distributed()
    return args.func(args) or 0
  except ValueError as err:
    print(f"kvjax {args.command}: error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
