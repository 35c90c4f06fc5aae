"""`kvjax bench NAME [options]`: run one benchmark and print its result as JSON. Every ratio is
measured in one run.

Each benchmark is a module of kvjax.bench that declares a kvjax.bench.base.registry.Benchmark: its
options as data (turned into command-line options here, the one place argparse lives), the
settings --set changes where it takes any (the benchmark model, kvjax.bench.base.harness.BENCH_MODEL;
for decode also its cache), and run(). `kvjax bench NAME --help` shows one benchmark's options.
"""

from __future__ import annotations

import argparse
import json

from kvjax.bench.base.registry import Benchmark, Kind, Option, benchmarks
from kvjax.cli import options

BENCHMARKS = benchmarks()


def counts(text: str) -> list[int]:
  """The argparse type of a Kind.COUNTS option: comma-separated positive integers."""
  return [options.positive_int(x) for x in text.split(",")]


def names(choices: tuple[str, ...]):
  """The argparse type of a Kind.NAMES option: comma-separated names of `choices`, at least one."""

  def parse(text: str) -> list[str]:
    picked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(picked) - set(choices))
    if not picked or unknown:
      raise argparse.ArgumentTypeError(f"must name some of {','.join(choices)}, got {text!r}")
    return picked

  return parse


TYPES = {
  Kind.COUNT: options.positive_int,
  Kind.NONNEGATIVE: options.nonnegative_int,
  Kind.COUNTS: counts,
  Kind.SOURCE: options.path_text,
  Kind.PROGRAM: options.program_path,
}


def option_help(option: Option) -> str:
  """The option's help, with its choices and its default (when it has one) as the command line writes them."""
  text = option.help
  if option.choices:
    text += f", of {','.join(option.choices)}"
  if option.default is not None and not option.required:
    shown = ",".join(map(str, option.default)) if isinstance(option.default, list) else option.default
    text += f" (default: {shown})"
  return text


def add_benchmark(subparsers, benchmark: Benchmark) -> None:
  """`kvjax bench NAME` with the benchmark's own options, --set where it takes a config, and --json."""
  parser = subparsers.add_parser(
    benchmark.name,
    help=benchmark.summary,
    description=benchmark.description or benchmark.summary,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  for option in benchmark.options:
    parse = names(option.choices) if option.kind is Kind.NAMES else TYPES[option.kind]
    parser.add_argument(
      option.flag, type=parse, default=option.default, required=option.required, help=option_help(option)
    )
  if benchmark.config is not None:
    options.add_set_option(parser)
  parser.add_argument("--json", action="store_true", help="one line of JSON")
  parser.set_defaults(subcommand_parser=parser)  # refuses what is left over (kvjax.cli.main.parse_args)


def command(args: argparse.Namespace) -> int:
  benchmark = BENCHMARKS[args.benchmark]
  values = {option.name: getattr(args, option.name) for option in benchmark.options}
  if benchmark.config is not None:
    values["config"] = options.apply_set(benchmark.config, args)
  print(json.dumps(benchmark.run(**values), indent=None if args.json else 2))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
    "bench",
    help="decoding benchmarks (JSON)",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.set_defaults(func=command)
  benchmark_parsers = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK", title="benchmarks")
  for benchmark in BENCHMARKS.values():
    add_benchmark(benchmark_parsers, benchmark)
