"""The `kvjax` command line: one subcommand per module of kvjax.cli.

Every module in COMMANDS provides `add_parser(subparsers)`, which registers its subcommand and
sets `func` on it, and `command(args)`, that `func`; `main` dispatches to it. Options that several
commands take (--set, --mesh) are defined once, in kvjax.cli.options.

An anticipated error (a bad config or option, a refused or locked workdir, a missing or damaged
checkpoint, a file that cannot be read or written: a ValueError or an OSError) prints one line,
`kvjax COMMAND: error: ...`, on stderr and exits with status 2; any other exception is a bug and
keeps its traceback. A command line argparse refuses (a malformed value, an unknown or left-over
argument) ends the same way, after its usage. tests/cli/test_fuzz.py holds every command to this.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvjax import sharding
from kvjax.cli import bench, build_kernels, evaluate, export_hf, generate, import_model, kv_size, run, serve, uptrain

COMMANDS = (run, evaluate, generate, serve, uptrain, import_model, export_hf, kv_size, bench, build_kernels)


def one_line(message: str) -> str:
  """`message` on one line: its lines (a newline or carriage return in an argument included) joined."""
  return " ".join(line.strip() for line in message.splitlines() if line.strip())


class Parser(argparse.ArgumentParser):
  """argparse's parser (and its subcommands'), whose error message is one line."""

  def error(self, message: str):
    super().error(one_line(message))


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(
    prog="kvjax", description="kvjax: KV-cache-efficient decoding for decoder-only transformers in JAX/Flax."
  )
  subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for module in COMMANDS:
    module.add_parser(subparsers)
  parser.set_defaults(commands=subparsers.choices)
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line parsed; a malformed one exits with status 2 after one `kvjax COMMAND: error:`
  line (argparse's), arguments left over included: they are the subcommand's to refuse, not
  `kvjax`'s (a command with subcommands of its own, `kvjax bench NAME`, names the one that refused
  them in `subcommand_parser`)."""
  args, extra = build_parser().parse_known_args(argv)
  parser = getattr(args, "subcommand_parser", None) or args.commands[args.command]
  if extra:
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  # argparse reads `--option=--` as an empty list, without calling the option's type.
  for token in sys.argv[1:] if argv is None else argv:
    if token.startswith("--") and token.endswith("=--"):
      parser.error(f"argument {token[:-3]}: expected a value, got '--'")
  return args


def quiet_library_logs() -> None:
  """Orbax logs, through absl, the traceback of every failed background write (and asyncio the
  tasks it leaves pending); the same error then reaches `main` as an exception, so on the
  command line those logs only bury its one line. So do the reads a failed restore of a damaged
  checkpoint leaves behind: they end later as unraisable exceptions (orbax's read coroutines,
  asyncio's "Event loop is closed"), which are dropped."""
  for name in ("absl", "asyncio"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  if sys.unraisablehook is not _drop_abandoned_reads:
    _drop_abandoned_reads.previous = sys.unraisablehook
    sys.unraisablehook = _drop_abandoned_reads


def _drop_abandoned_reads(unraisable) -> None:
  code = getattr(unraisable.object, "cr_code", None)
  abandoned = (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename) or (
    isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
  )
  if not abandoned:
    _drop_abandoned_reads.previous(unraisable)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  quiet_library_logs()
  try:
    sharding.initialize_distributed()
    return args.func(args) or 0
  except (ValueError, OSError) as err:
    print(f"kvjax {args.command}: error: {one_line(str(err))}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"kvjax {args.command}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
