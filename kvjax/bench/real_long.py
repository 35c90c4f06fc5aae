"""`kvjax bench real_long --model NAME`: whole long requests, kvjax beside `transformers`, each side in
its own process.

A cell is one request shape (batch x prompt tokens + new tokens), one weight format and one side:
kvjax with one cache codec, or `transformers` (the same weight format) with one of its caches
(static or dynamic). Each cell runs in a subprocess of its own (`python -m kvjax.bench.real_long
SPEC.json`, kvjax.bench.parts.real_long_side), so its peak resident memory is that side's alone; the
parent makes the prompts (held-out prose), gathers each cell's JSON and generated ids, and
compares: per phase (prefill, decode, the whole request) kvjax over `transformers`' best cache in
the same weight format, and the greedy agreement of every cell's ids with `transformers`' float32
ids of the same shape (the first of its caches run).

With `repeats` > 1 the cells run in alternating rounds (every cell once per round) and each
figure is the median round's. `kvjax bench real --parts long` runs one shape of this.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from kvjax.bench.base.harness import greedy_agreement
from kvjax.bench.parts.real_long_side import HF_CACHES, SIDES, Cell, read_tokenizer, run_spec
from kvjax.bench.peers.hf_model import check_source, prose_prompts
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.cache.codec import NAMES as CODECS
from kvjax.interop.importer import read_config, resolve_source
from kvjax.model.weights import FORMATS

PHASES = ("prefill", "decode", "request")


def plan(
  source: str,
  *,
  prompts=(2048, 8192),
  batches=(1, 8),
  new_tokens: int = 256,
  weights=("float32",),
  codecs=("float32", "int8"),
  hf_caches=HF_CACHES,
  sides=SIDES,
) -> list[Cell]:
  """The cells of one run, in the order they run; a request longer than the model takes is
  refused before anything loads, naming the longest prompt that fits."""
  config = read_config(source)
  if new_tokens < 1:
    raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
  for prompt in prompts:
    if prompt + new_tokens - 1 > config.max_positions:
      raise ValueError(
        f"prompt {prompt} + new_tokens {new_tokens} needs {prompt + new_tokens - 1} positions, more than the "
        f"{config.max_positions} the model takes; its longest prompt with {new_tokens} new tokens is "
        f"{config.max_positions - new_tokens + 1}"
      )
  for name, values, valid in (
    ("weights", weights, FORMATS),
    ("codecs", codecs, CODECS),
    ("hf_caches", hf_caches, HF_CACHES),
    ("sides", sides, SIDES),
  ):
    bad = [v for v in values if v not in valid]
    if bad or not values:
      raise ValueError(f"{name} must name some of {list(valid)}, got {list(values)}")
  cells = []
  for prompt in prompts:
    for batch in batches:
      for fmt in weights:
        shape = dict(batch=batch, prompt=prompt, new_tokens=new_tokens, weights=fmt)
        if "hf" in sides:
          cells += [Cell(side="hf", cache=c, **shape) for c in hf_caches]
        if "kvjax" in sides:
          cells += [Cell(side="kvjax", cache=c, **shape) for c in codecs]
  return cells


def run_cell_process(
  source: str, cell: Cell, prompts_path: pathlib.Path, workdir: pathlib.Path
) -> tuple[dict, np.ndarray]:
  """One cell in a fresh Python process -> (its JSON result, int32[B, new_tokens] ids)."""
  spec = {
    "source": str(source),
    "cell": dataclasses.asdict(cell),
    "prompts": str(prompts_path),
    "ids": str(workdir / f"{cell.name}.npy"),
  }
  spec_path = workdir / f"{cell.name}.json"
  spec_path.write_text(json.dumps(spec))
  done = subprocess.run(
    [sys.executable, "-m", "kvjax.bench.real_long", str(spec_path)], capture_output=True, text=True, env=os.environ
  )
  if done.returncode != 0:
    raise RuntimeError(f"the {cell.name} cell failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1]), np.load(spec["ids"])


def compare(rows: list[dict]) -> None:
  """Adds to each kvjax row its ratios over `transformers`' best cache of the same shape and
  weight format, per phase (seconds: theirs / ours, so above 1 is kvjax faster)."""
  for row in rows:
    if row["side"] != "kvjax":
      continue
    peers = [r for r in rows if r["side"] == "hf" and _shape(r) == _shape(row) and r["weights"] == row["weights"]]
    if peers:
      row["over_hf_best"] = {p: min(r[f"{p}_s"] for r in peers) / row[f"{p}_s"] for p in PHASES}


def _shape(row: dict) -> tuple:
  return row["batch"], row["prompt"], row["new_tokens"]


def bench_long_requests(source: str, *, repeats: int = 1, progress=None, **cells) -> dict:
  """The cells of plan(source, **cells), each run `repeats` times in alternating rounds."""
  check_source(source)
  cells = plan(source, **cells)
  path = resolve_source(source)
  tokenizer = read_tokenizer(path)
  runs = {cell: [] for cell in cells}
  ids = {}
  with tempfile.TemporaryDirectory(prefix="kvjax_long_") as tmp:
    workdir = pathlib.Path(tmp)
    prompt_files = {}
    for cell in cells:
      key = (cell.batch, cell.prompt)
      if key not in prompt_files:
        prompt_files[key] = workdir / f"prompts_{cell.batch}x{cell.prompt}.npy"
        np.save(prompt_files[key], prose_prompts(tokenizer, cell.batch, cell.prompt))
    for _ in range(repeats):
      for cell in cells:
        result, ids[cell] = run_cell_process(source, cell, prompt_files[cell.batch, cell.prompt], workdir)
        runs[cell].append(result)
        if progress is not None:
          progress(cell, result)
  rows = []
  for cell, results in runs.items():
    middle = sorted(results, key=lambda r: r["request_s"])[len(results) // 2]
    row = {**middle, "request_s_rounds": [r["request_s"] for r in results]}
    reference = next((c for c in cells if c.side == "hf" and c.weights == "float32" and c.same_shape(cell)), None)
    if reference is not None:
      row["greedy_agreement_with"] = reference.name
      row["greedy_agreement"] = greedy_agreement(ids[cell], ids[reference])
    rows.append(row)
  compare(rows)
  return {"benchmark": "real_long", "source": str(path), "repeats": repeats, "rows": rows}


def print_progress(cell: Cell, result: dict) -> None:
  """Each cell's figures on stderr as it ends: a long run's figures survive an interruption."""
  print(f"kvjax bench real_long: {cell.name} done: {json.dumps(result)}", file=sys.stderr, flush=True)


def run(*, model, prompts, batches, new_tokens, weights, codecs, hf_caches, sides, repeats) -> dict:
  check_source(model)
  cells = dict(
    prompts=prompts,
    batches=batches,
    new_tokens=new_tokens,
    weights=weights,
    codecs=codecs,
    hf_caches=hf_caches,
    sides=sides,
  )
  plan(model, **cells)  # refuses a request the model cannot take before any process starts
  return bench_long_requests(model, repeats=repeats, progress=print_progress, **cells)


BENCHMARK = Benchmark(
  name="real_long",
  summary="whole long requests (prefill + decode) in kvjax and transformers, each side in its own process",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("prompts", [2048, 8192], "comma-separated prompt lengths (tokens)", Kind.COUNTS),
    Option("batches", [1, 8], "comma-separated batch sizes", Kind.COUNTS),
    Option("new_tokens", 256, "greedy tokens generated per row"),
    Option("weights", ["float32"], "comma-separated weight formats, each side in the same", Kind.NAMES, FORMATS),
    Option("codecs", ["float32", "int8"], "comma-separated kvjax cache codecs", Kind.NAMES, CODECS),
    Option("hf_caches", list(HF_CACHES), "comma-separated transformers caches", Kind.NAMES, HF_CACHES),
    Option("sides", list(SIDES), "which sides run", Kind.NAMES, SIDES),
    Option("repeats", 1, "alternating rounds of every cell (the median round's figures)"),
  ),
  description=__doc__,
)


if __name__ == "__main__":
  print(json.dumps(run_spec(json.loads(pathlib.Path(sys.argv[1]).read_text()))), flush=True)
