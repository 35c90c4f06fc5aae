"""The benchmarks' declarations: each module of kvjax.bench with a BENCHMARK is found, and each
declares options its run() takes, with defaults of their kind."""

from __future__ import annotations

import inspect
import sys

import pytest
from conftest import BENCHMARK_NAMES

import kvjax.bench
from kvjax.bench.base.registry import Benchmark, Kind, Option, benchmarks

NAMES = set(BENCHMARK_NAMES)


def test_every_benchmark_is_found_in_its_own_module():
  found = benchmarks()
  assert set(found) == NAMES and list(found) == sorted(NAMES)
  for name, benchmark in found.items():
    module = benchmark.run.__module__  # kvjax.bench.NAME, or kvjax.bench.GROUP.NAME
    assert module in (f"kvjax.bench.{name}", *(f"kvjax.bench.{g}.{name}" for g in ("serving",)))
    assert benchmark.summary and "\n" not in benchmark.summary
    assert benchmark.description == sys.modules[module].__doc__


@pytest.mark.parametrize("name", sorted(NAMES))
def test_run_takes_exactly_the_declared_options(name):
  """What the command line passes (one keyword per option, and config= where --set applies) is
  what run() takes, all keyword-only: an option declared but never used, or a run() keyword no
  option fills, fails here."""
  benchmark = benchmarks()[name]
  parameters = inspect.signature(benchmark.run).parameters
  expected = {o.name for o in benchmark.options} | ({"config"} if benchmark.config is not None else set())
  assert set(parameters) == expected
  assert all(p.kind is p.KEYWORD_ONLY for n, p in parameters.items() if n != "config")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_defaults_are_of_their_kind(name):
  for option in benchmarks()[name].options:
    default = option.default
    if default is None:
      continue
    assert not option.required
    if option.kind is Kind.COUNT:
      assert isinstance(default, int) and default >= 1, option
    elif option.kind is Kind.NONNEGATIVE:
      assert isinstance(default, int) and default >= 0, option
    elif option.kind is Kind.COUNTS:
      assert default and all(isinstance(x, int) and x >= 1 for x in default), option
    elif option.kind is Kind.NAMES:
      assert default and set(default) <= set(option.choices), option
    else:
      pytest.fail(f"{name}: {option} has a default, but a source is the user's to name")


def test_a_new_module_is_a_new_benchmark(tmp_path, monkeypatch):
  """Adding a benchmark is adding its module; two modules with one name are refused."""
  body = (
    "from kvjax.bench.base.registry import Benchmark, Option\n"
    "def run(*, size):\n  return {'size': size}\n"
    "BENCHMARK = Benchmark(name='toy', summary='a toy', run=run, options=(Option('size', 2, 'rows'),))\n"
  )
  (tmp_path / "toy_bench.py").write_text(body)
  monkeypatch.setattr(kvjax.bench, "__path__", [*kvjax.bench.__path__, str(tmp_path)])
  try:
    found = benchmarks()
    assert set(found) == NAMES | {"toy"} and found["toy"].run(size=3) == {"size": 3}
    (tmp_path / "toy_again.py").write_text(body)
    with pytest.raises(ValueError, match="two modules of kvjax.bench declare the benchmark 'toy'"):
      benchmarks()
  finally:
    for module in ("kvjax.bench.toy_bench", "kvjax.bench.toy_again"):
      sys.modules.pop(module, None)


def test_declarations_are_checked():
  with pytest.raises(ValueError, match="Option.name='page-size' must be a Python identifier"):
    Option("page-size", 16, "tokens per page")
  with pytest.raises(ValueError, match="choices go with kind NAMES"):
    Option("parts", ["a"], "parts", Kind.NAMES)
  with pytest.raises(ValueError, match="option names must be distinct and not 'config'"):
    Benchmark("x", "x", run=dict, options=(Option("batch", 1, "rows"), Option("batch", 2, "rows")))
  assert Option("page_size", 16, "tokens per page").flag == "--page-size"
