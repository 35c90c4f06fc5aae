"""The presses table kvpress's users know: every press at every compression ratio on the
RULER-style suite (kvjax.studies.ruler), per model, length and protocol, with the full cache as
the ceiling and the KV bytes per token each cache holds.

Cells: for each source model, the suite's samples at each length (written once to
WORKDIR/<model>/samples.jsonl, with the tokenizer's stop ids so that a peer can answer the same
ids); the full cache once (its answers do not depend on the protocol), then each press of
`presses` ("snapkv", "snapkv:adaptive" for AdaKV's head-adaptive budgets, "snapkv:pyramid" for
PyramidKV's per-layer ones, which is kvpress's PyramidKVPress) at each ratio under
each protocol (kvjax.studies.eviction.PROTOCOLS). Every cell's per-sample answers are a file of
WORKDIR/<model>/cells/, written when the cell is done, so a rerun skips finished cells and an
interrupted table resumes.

Agreement with kvpress: `experiments/kvpress_reference.py --samples WORKDIR/<model>/samples.jsonl
--out WORKDIR/<model>/kvpress.jsonl` answers the same token ids through transformers and kvpress;
when that file exists, each row gains the share of its samples that kvpress scores the same
(its answer ids decoded by kvjax's tokenizer and scored by kvjax's scorer), sample by sample.

Run: kvjax run configs/press_table/cpu.py --workdir runs/press_table
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import make_press
from kvjax.fields import check_nonnegative, check_positive
from kvjax.studies import measure, report
from kvjax.studies.eviction import PROTOCOLS
from kvjax.studies.ruler import answer, build, check_lengths, load, method_name
from kvjax.studies.ruler_tasks import TASKS, check_tasks
from kvjax.studies.scoring import read_jsonl, score, write_jsonl

FULL = "full"


def press_cache(spec: str, ratio: float) -> CacheConfig:
  """The cache of a press spec ("snapkv", "snapkv:adaptive" for AdaKV's per-head budgets,
  "snapkv:pyramid" for PyramidKV's per-layer ones, "snapkv:adaptive:pyramid") at a compression
  ratio; ValueError naming an unknown press, suffix or ratio."""
  name, *suffixes = spec.split(":")
  if suffixes not in ([], ["adaptive"], ["pyramid"], ["adaptive", "pyramid"]):
    raise ValueError(
      f"PressTableStudy.presses: {spec!r}: the suffixes are ':adaptive' (AdaKV's budgets) and then "
      "':pyramid' (PyramidKV's)"
    )
  heads = "adaptive" if "adaptive" in suffixes else "uniform"
  layers = "pyramid" if "pyramid" in suffixes else "uniform"
  return CacheConfig(press=make_press(name, compression_ratio=ratio, heads=heads, layers=layers))


@dataclasses.dataclass(frozen=True)
class PressTableStudy:
  """sources: models (named, a GGUF file or an imported workdir); the suite's `tasks` at `lengths`,
  `samples` per task and length; `presses` x `ratios` x `protocols` beside the full cache."""

  sources: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")
  lengths: tuple[int, ...] = (1024, 2048)
  tasks: tuple[str, ...] = tuple(TASKS)
  samples: int = 4
  presses: tuple[str, ...] = (
    "streaming_llm",
    "snapkv",
    "tova",
    "observed",
    "knorm",
    "snapkv:adaptive",
    "snapkv:pyramid",
    "keydiff",
    "expected_attention",
    "kvzip",
  )
  ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 0.875)
  protocols: tuple[str, ...] = PROTOCOLS
  batch_size: int = 8
  seed: int = 0
  job: str = "press_table"

  def __post_init__(self):
    if self.job != "press_table":
      raise ValueError(f"PressTableStudy.job must be 'press_table', got {self.job!r}")
    if not self.sources:
      raise ValueError("PressTableStudy.sources must name at least one model")
    check_positive(self, "samples", "batch_size")
    check_nonnegative(self, "seed")
    check_tasks(self.tasks)
    check_lengths(self.lengths)
    for protocol in self.protocols:
      if protocol not in PROTOCOLS:
        raise ValueError(f"PressTableStudy.protocols: {protocol!r} is not one of {PROTOCOLS}")
    for ratio in self.ratios:
      if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ValueError(f"PressTableStudy.ratios: {ratio!r} is not a compression ratio in (0, 1)")
    for spec in self.presses:
      press_cache(spec, 0.5)


def cells(study: PressTableStudy) -> list[tuple[str, str, CacheConfig]]:
  """(method, protocol, cache) of every cell, the full cache first (query-agnostic only)."""
  out = [(FULL, PROTOCOLS[0], CacheConfig())]
  for spec in study.presses:
    for ratio in study.ratios:
      cache_config = press_cache(spec, ratio)
      out += [(method_name(cache_config), protocol, cache_config) for protocol in study.protocols]
  return out


def agreement(tokenizer, samples: list[dict], ours: list[dict], theirs: Path) -> dict[tuple, dict]:
  """{(method, protocol, length): {"same_score": the share of samples where kvpress's answer (file
  `theirs`) scores as kvjax's does, "same_answer": the share where the two answers are the same
  text}}, over the samples both answered; kvpress's ids are decoded and scored by kvjax's
  tokenizer and scorer."""
  if not theirs.exists():
    return {}
  by_id = {s["id"]: s for s in samples}
  peer = {}
  for row in read_jsonl(theirs):
    s = by_id.get(row["id"])
    if s is None:
      continue
    text = tokenizer.decode(np.asarray(row["answer_ids"][: s["answer_tokens"]], np.int32), skip_special_tokens=True)
    peer[(row["id"], row["method"], row["protocol"])] = (text, score(text, s["references"]))
  pairs: dict[tuple, list[tuple[bool, bool]]] = {}
  for r in ours:
    key = (r["id"], r["method"], r["protocol"])
    if key in peer:
      text, value = peer[key]
      pairs.setdefault((r["method"], r["protocol"], r["length"]), []).append((value == r["score"], text == r["answer"]))
  return {
    k: {"same_score": float(np.mean([a for a, _ in v])), "same_answer": float(np.mean([b for _, b in v]))}
    for k, v in pairs.items()
  }


def run_model(study: PressTableStudy, source: str, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Every cell of one model -> its rows; files under workdir/<model name>/."""
  model, params, tokenizer, name = load(source)
  folder = workdir / Path(name).stem
  samples = build(
    tokenizer, study.tasks, study.lengths, study.samples, seed=study.seed, max_len=model.config.max_positions
  )
  stops = [int(i) for i in tokenizer.stop_ids]
  write_jsonl(folder / "samples.jsonl", [{**s, "stop_ids": stops} for s in samples])
  results = []
  for name_, protocol, cache_config in cells(study):
    path = folder / "cells" / f"{name_}_{protocol}.jsonl"
    if not path.exists():
      progress(f"press_table: {folder.name} {name_} {protocol}")
      start = time.perf_counter()
      found = answer(model, params, tokenizer, samples, cache_config, protocol=protocol, batch_size=study.batch_size)
      seconds = time.perf_counter() - start
      write_jsonl(path, [{**r, "method": name_, "protocol": protocol, "seconds": seconds} for r in found])
    results += read_jsonl(path)
  write_jsonl(folder / "answers.jsonl", results)
  agree = agreement(tokenizer, samples, results, folder / "kvpress.jsonl")
  rows = []
  cache_of = {(m, p): c for m, p, c in cells(study)}
  for (name_, protocol), cache_config in cache_of.items():
    for length in study.lengths:
      mine = [r for r in results if r["method"] == name_ and r["protocol"] == protocol and r["length"] == length]
      by_task: dict[str, list[float]] = {}
      for r in mine:
        by_task.setdefault(r["task"], []).append(r["score"])
      press, _, ratio = name_.partition("@")
      rows.append(
        {
          "model": folder.name,
          "press": press,
          "ratio": float(ratio) if ratio else 0.0,
          "protocol": protocol if name_ != FULL else "either",
          "length": length,
          "score": 100.0 * float(np.mean([np.mean(v) for v in by_task.values()])),
          "kv_bytes_per_token": measure.kv_bytes_per_token(model.config, cache_config, length),
          "kvpress_same_score": agree.get((name_, protocol, length), {}).get("same_score"),
          "kvpress_same_answer": agree.get((name_, protocol, length), {}).get("same_answer"),
          "samples": len(mine),
          **{f"task_{t}": 100.0 * float(np.mean(v)) for t, v in by_task.items()},
        }
      )
  return rows


def run(study: PressTableStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Every model's cells -> rows {model, press, ratio, protocol, length, score, kv_bytes_per_token,
  kvpress_same_score, kvpress_same_answer, samples, task_*}; writes press_table.{md,csv,json}."""
  workdir = Path(workdir)
  rows = []
  for source in study.sources:
    rows += run_model(study, source, workdir, progress)
  columns = [
    ("model", "model", ""),
    ("press", "press", ""),
    ("ratio", "ratio", ".3f"),
    ("protocol", "protocol", ""),
    ("length", "tokens", ""),
    ("score", "suite score %", ".1f"),
    ("kv_bytes_per_token", "KV bytes / token", ".0f"),
    ("kvpress_same_score", "same score as kvpress", ".0%"),
    ("kvpress_same_answer", "same answer as kvpress", ".0%"),
  ]
  table = report.write_table(rows, workdir / "press_table", columns)
  (workdir / "press_table.md").write_text(
    f"Presses on the RULER-style suite: {study.samples} samples per task and length, tasks "
    f"{', '.join(study.tasks)}, seed {study.seed}\n\n{table}\n"
  )
  return rows
