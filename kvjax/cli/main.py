"""The `kvjax` command line: one subcommand per job, each defined beside the code it runs.

Every module in SUBCOMMANDS provides `add_parser(subparsers)`, which registers its
subcommand and sets `func` on it; `main` dispatches to that function.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvjax import sharding

SUBCOMMANDS = ("kvjax.bench.benchmarks", "kvjax.cli.run", "kvjax.training.evaluate", "kvjax.cli.generate", "kvjax.interop.hf", "kvjax.interop.kv_size", "kvjax.conversion.uptrain")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="kvjax", description="kvjax: KV-cache-efficient decoding for decoder-only transformers in JAX/Flax.")
  subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for module in SUBCOMMANDS:
    importlib.import_module(module).add_parser(subparsers)
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
