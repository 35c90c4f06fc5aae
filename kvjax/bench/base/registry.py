"""What a benchmark declares, and the benchmarks found in kvjax.bench.

A benchmark is one module of kvjax.bench holding a `BENCHMARK = Benchmark(...)`: its name (the
`kvjax bench NAME` subcommand), a one-line summary for `kvjax bench --help`, its options as data
(kvjax.cli.bench turns each Option into a command-line option: argparse lives in the cli layer),
the settings --set changes if it takes any, and `run(**values) -> dict`, the JSON-ready result.
Adding a benchmark is adding its module (and its tests): `benchmarks()` finds it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
from typing import Any, Callable


class Kind(enum.Enum):
  """How an option's text is read on the command line."""

  COUNT = "count"  # an integer >= 1
  NONNEGATIVE = "nonnegative"  # an integer >= 0 (0: none, or the library's default)
  COUNTS = "counts"  # comma-separated integers >= 1, as a list
  NAMES = "names"  # comma-separated names of Option.choices, as a list
  SOURCE = "source"  # a pretrained model: a name kvjax knows, a .gguf, a Hugging Face folder
  PROGRAM = "program"  # an executable file (another environment's Python)


@dataclasses.dataclass(frozen=True)
class Option:
  """One option of a benchmark, `--NAME` on the command line (underscores written as dashes),
  passed to its run() as the keyword `name`. A default of None means "not given": run() decides."""

  name: str
  default: Any
  help: str
  kind: Kind = Kind.COUNT
  choices: tuple[str, ...] = ()
  required: bool = False

  def __post_init__(self):
    if not self.name.isidentifier():
      raise ValueError(f"Option.name={self.name!r} must be a Python identifier (it is run()'s keyword)")
    if (self.kind is Kind.NAMES) != bool(self.choices):
      raise ValueError(f"Option {self.name!r}: choices go with kind NAMES, and NAMES needs them")

  @property
  def flag(self) -> str:
    return "--" + self.name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """`kvjax bench NAME`. `run(**values)` gets one keyword per option and, when `config` is not
  None, `config=`: `config` with the --set overrides applied (a frozen config dataclass, e.g. the
  benchmark model). `description` is the long help (the module's docstring)."""

  name: str
  summary: str
  run: Callable[..., dict]
  options: tuple[Option, ...] = ()
  config: Any = None
  description: str = ""

  def __post_init__(self):
    names = [o.name for o in self.options]
    if len(set(names)) < len(names) or "config" in names:
      raise ValueError(f"benchmark {self.name!r}: option names must be distinct and not 'config', got {names}")


# The folders of kvjax.bench that hold what benchmarks share, not benchmarks.
SHARED = ("base", "parts", "peers")


def benchmarks() -> dict[str, Benchmark]:
  """{name: Benchmark} of every module of kvjax.bench, or of a folder of it grouping benchmarks
  by subject (kvjax.bench.serving), that declares a BENCHMARK, by name."""
  import kvjax.bench

  modules = []
  for info in pkgutil.iter_modules(kvjax.bench.__path__):
    if not info.ispkg:
      modules.append(f"kvjax.bench.{info.name}")
    elif info.name not in SHARED:
      group = importlib.import_module(f"kvjax.bench.{info.name}")
      modules += [f"{group.__name__}.{sub.name}" for sub in pkgutil.iter_modules(group.__path__)]
  found = {}
  for module in modules:
    benchmark = getattr(importlib.import_module(module), "BENCHMARK", None)
    if benchmark is not None:
      if benchmark.name in found:
        raise ValueError(f"two modules of kvjax.bench declare the benchmark {benchmark.name!r}")
      found[benchmark.name] = benchmark
  return dict(sorted(found.items()))


# The option of the benchmarks that run a pretrained model (kvjax.interop.importer.read_model's source).
PRETRAINED_MODEL = Option(
  "model", None, "the pretrained model (e.g. smollm2-135m, a .gguf, a Hugging Face folder)", Kind.SOURCE, required=True
)
