"""`kvjax bench NAME [options]`: each benchmark a subcommand with its own options and help, the
command line handed to its run() as declared, and bad input refused in one line."""

from __future__ import annotations

import json
import re
import sys

import pytest
from conftest import BENCHMARK_NAMES

from kvjax.bench import decode, hf, nocache, real
from kvjax.bench.serving import paged
from kvjax.bench.base.harness import BENCH_MODEL
from kvjax.cache.config import CacheConfig
from kvjax.cli import bench
from kvjax.cli import main as cli

NAMES = list(BENCHMARK_NAMES)


def kvjax(argv: list[str], capsys) -> tuple[int, str, str]:
  try:
    code = cli.main(argv)
  except SystemExit as exit_:
    code = exit_.code
  out, err = capsys.readouterr()
  return code, out, err


def test_help_lists_every_benchmark_on_one_line(capsys):
  code, out, _ = kvjax(["bench", "--help"], capsys)
  assert code == 0
  listed = re.findall(r"^    (\w+)\s", out, re.MULTILINE)  # a long name takes a line of its own
  assert listed == NAMES
  for name in NAMES:
    summary = " ".join(bench.BENCHMARKS[name].summary.split())
    assert summary in " ".join(out.split())


@pytest.mark.parametrize(
  "name, own, others, default",
  [
    (
      "paged",
      ["--batch", "--context", "--page-size", "--repeats", "--set", "--json"],
      ["--lengths", "--model"],
      "tokens per page (default: 16)",
    ),
    (
      "nocache",
      ["--prompt", "--lengths", "--concat-max", "--repeats", "--set"],
      ["--batch", "--context"],
      "(default: 64,128,256,512)",
    ),
    ("real", ["--model", "--parts", "--repeats", "--json"], ["--set", "--batch", "--context"], "(default: 3)"),
    (
      "real_long",
      ["--model", "--prompts", "--batches", "--new-tokens", "--weights", "--codecs", "--hf-caches", "--sides"],
      ["--set", "--parts", "--context"],
      "(default: 2048,8192)",
    ),
    (
      "engine",
      ["--model", "--requests", "--weights", "--time-limit", "--peer", "--json"],
      ["--set", "--parts", "--repeats"],
      "(default: 1800)",
    ),
  ],
)
def test_help_of_a_benchmark_shows_its_options_only(name, own, others, default, capsys):
  code, out, _ = kvjax(["bench", name, "--help"], capsys)
  flags = set(re.findall(r"--[a-z-]+", out.split("options:")[1]))
  assert code == 0 and set(own) <= flags and not set(others) & flags
  assert default in " ".join(out.split())


def record(monkeypatch, module, function: str) -> list:
  """Replaces module.function by one that records its arguments and returns them."""
  calls = []

  def recorded(*args, **kwargs):
    calls.append((args, kwargs))
    return {"benchmark": function}

  monkeypatch.setattr(module, function, recorded)
  return calls


def test_options_reach_the_benchmark_as_given(monkeypatch, capsys):
  calls = record(monkeypatch, paged, "bench_paged")
  code, out, _ = kvjax(["bench", "paged", "--set", "model.num_kv_heads=8", "--batch", "2", "--json"], capsys)
  assert code == 0 and json.loads(out) == {"benchmark": "bench_paged"} and "\n" not in out.strip()
  assert calls == [
    ((BENCH_MODEL.replace(num_kv_heads=8),), {"batch": 2, "context": 1024, "page_size": 16, "repeats": 5})
  ]


def test_defaults_are_the_ones_documented_runs_used(monkeypatch, capsys):
  """`kvjax bench nocache`, `decode --set cache.*`, `hf` (toy) and `real`: the arguments the
  commands in docs/results.md ran with."""
  calls = record(monkeypatch, nocache, "bench_nocache")
  assert kvjax(["bench", "nocache", "--lengths", "512", "--prompt", "16"], capsys)[0] == 0
  assert calls[0][1] == {"prompt": 16, "new_token_counts": [512], "concat_max": 64, "repeats": 5}
  calls = record(monkeypatch, decode, "bench_decode")
  assert kvjax(["bench", "decode", "--set", "cache.dtype='int8'", "--new", "1"], capsys)[0] == 0
  assert calls[0] == (
    (BENCH_MODEL,),
    {"batch": 8, "prompt": 128, "new_tokens": 1, "repeats": 5, "cache_config": CacheConfig(dtype="int8")},
  )
  calls = record(monkeypatch, hf, "bench_hf")
  assert kvjax(["bench", "hf"], capsys)[0] == 0
  assert calls[0][1] == {"batch": 8, "prompt": 128, "new_tokens": 128, "repeats": 5, "threads": 0}
  calls = record(monkeypatch, real, "bench_real")
  monkeypatch.setattr(real, "check_source", lambda source: None)
  assert kvjax(["bench", "real", "--model", "m", "--parts", "decode,long"], capsys)[0] == 0
  assert calls[0] == (
    ("m",),
    {
      "parts": ["decode", "long"],
      "repeats": 3,
      "prefill_repeats": 1,
      "llamacpp_python": None,
      "progress": real.print_progress,
    },
  )
  python = sys.executable  # an executable file
  assert kvjax(["bench", "real", "--model", "m", "--llamacpp-python", python], capsys)[0] == 0
  assert calls[1][1]["llamacpp_python"] == python


def test_hf_with_a_model_runs_it_at_batch_1_and_8(monkeypatch, capsys):
  calls = record(monkeypatch, hf, "bench_pretrained")
  monkeypatch.setattr(hf, "check_source", lambda source: None)
  assert kvjax(["bench", "hf", "--model", "m", "--repeats", "2"], capsys)[0] == 0
  assert calls == [(("m",), {"batches": (1, 8), "prompt": 128, "new_tokens": 128, "repeats": 2})]


@pytest.mark.parametrize(
  "argv, message",
  [
    (["bench", "bogus"], "kvjax bench: error: argument BENCHMARK: invalid choice: 'bogus'"),
    (["bench"], "kvjax bench: error: the following arguments are required: BENCHMARK"),
    (["bench", "decode", "--context", "64"], "kvjax bench decode: error: unrecognized arguments: --context 64"),
    (
      ["bench", "real", "--model", "m", "--set", "model.d_model=8"],
      "kvjax bench real: error: unrecognized arguments: --set",
    ),
    (["bench", "evict"], "kvjax bench evict: error: the following arguments are required: --model"),
    (["bench", "real", "--model", "m", "--parts", "decode,x"], "argument --parts: must name some of decode,"),
    (
      ["bench", "real", "--model", "m", "--llamacpp-python", "/no/such/python"],
      "argument --llamacpp-python: /no/such/python is not an executable file",
    ),
    (["bench", "paged", "--set", "cache.dtype='int8'"], "kvjax bench: error: unknown config key 'cache.dtype'"),
    (["bench", "hf", "--model", "m", "--set", "model.num_layers=2"], "with --model the pretrained model is used"),
    (
      ["bench", "decode", "--prompt", "2000", "--new", "100"],
      "--prompt 2000 + 100 new tokens need 2099 cache positions",
    ),
    (["bench", "perplexity", "--model", "/no/such/model"], "/no/such/model is neither a named model"),
  ],
)
def test_bad_input_is_one_error_line(argv, message, monkeypatch, capsys):
  for module, function in ((decode, "bench_decode"), (hf, "bench_pretrained")):
    monkeypatch.setattr(module, function, lambda *a, **k: pytest.fail("the benchmark ran"))
  code, _, err = kvjax(argv, capsys)
  lines = err.strip().splitlines()
  assert code == 2 and "Traceback" not in err and message in lines[-1]
