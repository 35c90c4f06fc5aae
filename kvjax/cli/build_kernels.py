"""`kvjax build-kernels`: build kvjax's CPU kernels now, before anything is traced
(kvjax.kernels.build.build), and print what was built as JSON. A failed build prints the
compiler's message and exits 1."""

from __future__ import annotations

import argparse
import json
import sys

from kvjax.kernels import build


def command(args: argparse.Namespace) -> int:
  try:
    result = build.build()
  except RuntimeError as err:
    print(f"kvjax build-kernels: error: {err}", file=sys.stderr)
    return 1
  print(json.dumps(result, indent=2))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
    "build-kernels", help="build the CPU kernels ahead of use and print what was built", description=__doc__
  )
  parser.set_defaults(func=command)
