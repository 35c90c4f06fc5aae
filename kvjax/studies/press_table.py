"""The presses table kvpress's users know: every press at every compression ratio on the
RULER-style suite (kvjax.studies.ruler), per model, length and protocol, with the full cache as
the ceiling and the KV bytes per token each cache holds.

Cells: for each source model, the suite's samples at each length (written once to
WORKDIR/<model>/samples.jsonl, with the tokenizer's stop ids so that a peer can answer the same
ids); the full cache once (its answers do not depend on the protocol), then each press of
`presses` ("snapkv", "snapkv:adaptive" for AdaKV's head-adaptive budgets, "snapkv:pyramid" for
PyramidKV's per-layer ones, which is kvpress's PyramidKVPress) at each ratio under
each protocol (kvjax.studies.base.measure.PROTOCOLS), and the codec cells (a press through a codec).

One prefill per sample: a press compresses what a layer stores after it attended over the whole
prompt, so each sample is prefilled once per protocol for all its cells and their answers decoded
in one batch (kvjax.studies.suite.ruler_answers.answer_cells over kvjax.decoding.many), the same answers as
cell by cell (shared_prefill=False, the reference). Each sample's records are appended to
WORKDIR/<model>/records.jsonl as it finishes, so an interrupted table resumes where it stopped and
a cell added later is answered alone; each finished cell's answers are also a file of
WORKDIR/<model>/cells/. A press a model refuses (KVzip on Gemma 3's windowed layers) is a row
marked refused, with the reason.

Head counts beside the presses: `conversions` names models converted from a source (kvjax
workdirs with a checkpoint and the source's tokenizer: MQA from SmolLM2's 3 kv heads, say, made by
configs/real_gqa/smollm2.py), each answered through its full cache on the source's samples and
shown in the source's panels as the row "heads:<workdir name>" at its own KV bytes per token. A
workdir without a checkpoint is a row marked refused, naming it.

Agreement with kvpress: `experiments/kvpress_reference.py --samples WORKDIR/<model>/samples.jsonl
--out WORKDIR/<model>/kvpress.jsonl` answers the same token ids through transformers and kvpress;
when that file exists (kvjax.studies.parts.press_peer), each row gains the share of its samples that kvpress scores the same
(its answer ids decoded by kvjax's tokenizer and scored by kvjax's scorer), sample by sample.

Run: kvjax run configs/press_table/cpu.py --workdir runs/press_table
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig, cache_name
from kvjax.cache.presses import make_press
from kvjax.decoding import many
from kvjax.config import ModelConfig
from kvjax.fields import check_nonnegative, check_positive, from_dict, to_dict
from kvjax.studies.base import measure, report
from kvjax.studies.base.measure import PROTOCOLS
from kvjax.studies.parts.press_board import FULL, HEADS, board, figures
from kvjax.studies.parts.press_peer import agreement
from kvjax.studies.suite.ruler_answers import answer, answer_cells, build, check_lengths, load
from kvjax.studies.suite.ruler_tasks import TASKS, check_tasks
from kvjax.studies.base.scoring import check_answer_end, read_jsonl, write_jsonl
from kvjax.training.checkpoint import latest_step


def press_cache(spec: str, ratio: float) -> CacheConfig:
  """The cache of a press spec ("snapkv", "snapkv:adaptive" for AdaKV's per-head budgets,
  "snapkv:pyramid" for PyramidKV's per-layer ones, "snapkv:adaptive:pyramid"; "+<dtype>" after
  any of them stores the kept tokens through that codec, e.g. "snapkv+int8") at a compression
  ratio; ValueError naming an unknown press, suffix, codec or ratio."""
  spec, _, dtype = spec.partition("+")
  if spec == FULL:  # every token, through a codec: "full+int8"
    return CacheConfig(dtype=dtype or None)
  name, *suffixes = spec.split(":")
  if suffixes not in ([], ["adaptive"], ["pyramid"], ["adaptive", "pyramid"]):
    raise ValueError(
      f"PressTableStudy.presses: {spec!r}: the suffixes are ':adaptive' (AdaKV's budgets) and then "
      "':pyramid' (PyramidKV's)"
    )
  heads = "adaptive" if "adaptive" in suffixes else "uniform"
  layers = "pyramid" if "pyramid" in suffixes else "uniform"
  return CacheConfig(dtype=dtype or None, press=make_press(name, compression_ratio=ratio, heads=heads, layers=layers))


@dataclasses.dataclass(frozen=True)
class PressTableStudy:
  """sources: models (named, a GGUF file or an imported workdir); the suite's `tasks` at `lengths`,
  `samples` per task and length; `presses` x `ratios` x `protocols` beside the full cache, and the
  `codec_cells` (press spec with its codec, e.g. "snapkv+int8", at a ratio). `long`: (source,
  length) pairs run beside, with the full cache and every press at `long_ratios` only.
  conversions: (source, workdir) pairs, a model converted from that source answered through its
  full cache at `lengths` (module docstring).
  answer_end: where an answer ends besides a stop id (kvjax.studies.base.scoring): "budget" at its
  task's budget, "line" also at its first line break.
  shared_prefill: one prefill and one batch of answers per sample for all its cells
  (kvjax.studies.suite.ruler_answers.answer_cells); False answers cell by cell (ruler_answers.answer), the
  reference it is timed against."""

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
    "cur",
    "lagkv",
    "chunkkv",
    "leverage",
    "compactor",
    "criticalkv",
  )
  ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 0.875)
  protocols: tuple[str, ...] = PROTOCOLS
  codec_cells: tuple[tuple[str, float], ...] = ()
  long: tuple[tuple[str, int], ...] = ()
  long_ratios: tuple[float, ...] = (0.75,)
  conversions: tuple[tuple[str, str], ...] = ()
  answer_end: str = "budget"
  shared_prefill: bool = True
  report_only: bool = False
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
    for name in ("ratios", "long_ratios"):
      for ratio in getattr(self, name):
        if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
          raise ValueError(f"PressTableStudy.{name}: {ratio!r} is not a compression ratio in (0, 1)")
    for spec in self.presses:
      press_cache(spec, 0.5)
    for i, cell in enumerate(self.codec_cells):
      if not (isinstance(cell, tuple) and len(cell) == 2):
        raise ValueError(f"PressTableStudy.codec_cells[{i}] must be (press spec, ratio), got {cell!r}")
      press_cache(*cell)
    for i, pair in enumerate(self.long):
      if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
        raise ValueError(f"PressTableStudy.long[{i}] must be (source, length), got {pair!r}")
      check_lengths((pair[1],))
    for i, pair in enumerate(self.conversions):
      if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
        raise ValueError(f"PressTableStudy.conversions[{i}] must be (source, workdir), got {pair!r}")
      if pair[0] not in self.sources:
        raise ValueError(f"PressTableStudy.conversions[{i}]: {pair[0]!r} is not one of the sources {self.sources}")
    check_answer_end(self.answer_end)
    for name in ("shared_prefill", "report_only"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"PressTableStudy.{name} must be True or False, got {getattr(self, name)!r}")


def cells(study: PressTableStudy, long: bool = False) -> list[tuple[str, str, CacheConfig]]:
  """(method, protocol, cache) of every cell, the full cache first (query-agnostic only); `long`:
  the cells of a `long` length (every press at long_ratios, no codec cells)."""
  out = [(FULL, PROTOCOLS[0], CacheConfig())]
  configs = [press_cache(spec, r) for spec in study.presses for r in (study.long_ratios if long else study.ratios)]
  configs += [] if long else [press_cache(*cell) for cell in study.codec_cells]
  for cache_config in configs:
    protocols = study.protocols if cache_config.press is not None else PROTOCOLS[:1]  # a full cache is either
    out += [(cache_name(cache_config), protocol, cache_config) for protocol in protocols]
  return out


def refusal(model, cache_config: CacheConfig, length: int) -> str | None:
  """Why a model cannot decode a `length`-token prompt through caches of cache_config (KVzip on
  windowed layers, say), or None."""
  try:
    kinds.create(model.config, cache_config, 1, length, prompt=length)
    if cache_config.press is not None and cache_config.press.compression_ratio > 0:
      cache_config.press.check_prompt(model.config.vocab_size)
  except ValueError as e:
    return str(e)
  return None


def run_model(study: PressTableStudy, source: str, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Every cell of one model -> its rows; files under workdir/<model name>/: samples.jsonl, the
  per-sample records as they finish (records.jsonl, and timing.jsonl: the seconds of each sample's
  cells together and the functions compiled so far), each finished cell's answers in cells/, answers.jsonl."""
  model, params, tokenizer, name = load(source)
  folder = workdir / Path(name).stem
  plan = [(length, False) for length in study.lengths]
  plan += [(length, True) for s, length in study.long if s == source and length not in study.lengths]
  samples = []
  for length, _ in plan:
    samples += build(
      tokenizer, study.tasks, (length,), study.samples, seed=study.seed, max_len=model.config.max_positions
    )
  stops = [int(i) for i in tokenizer.stop_ids]
  end = study.answer_end
  if not study.report_only:  # each sample with where its answer ends, for a peer to decode alike
    write_jsonl(folder / "samples.jsonl", [{**s, "stop_ids": stops, "answer_end": end} for s in samples])
  records = folder / "records.jsonl"
  done = {(r["id"], r["method"], r["protocol"]): r for r in (read_jsonl(records) if records.exists() else [])}
  done = {k: r for k, r in done.items() if r.get("answer_end", "budget") == end}  # answered as now
  refused, results = {}, []
  for length, long in plan:
    todo = []
    for name_, protocol, cache_config in cells(study, long):
      reason = refusal(model, cache_config.bind(tokenizer), length)
      if reason is None:
        todo.append((name_, protocol, cache_config))
      else:
        refused[(name_, protocol, length)] = reason
    mine = [s for s in samples if s["length"] == length]
    if study.report_only:  # what the records hold, nothing answered
      pass
    elif study.shared_prefill:
      _answer_by_sample(model, params, tokenizer, mine, todo, done, folder, end, progress)
    else:
      _answer_by_cell(model, params, tokenizer, mine, todo, done, folder, study.batch_size, end, progress)
    for name_, protocol, _ in todo:
      found = [done[(s["id"], name_, protocol)] for s in mine if (s["id"], name_, protocol) in done]
      path = folder / "cells" / f"{name_}_{protocol}_{length}.jsonl"
      if not path.exists() and len(found) == len(mine):
        write_jsonl(path, found)
      results += found
  converted = []
  for of, path in study.conversions:
    if of == source:
      found, made = _converted(study, path, samples, done, folder, end, progress)
      results += found
      converted.append(made)
  write_jsonl(folder / "answers.jsonl", results)
  if not study.report_only:
    (folder / "compilations.json").write_text(json.dumps(many.compilations(), indent=2) + "\n")
  agree = agreement(tokenizer, samples, results, folder / "kvpress.jsonl", end)
  rows = []
  for length, long in plan:
    for name_, protocol, cache_config in cells(study, long):
      rows.append(_row(model.config, folder.name, name_, protocol, cache_config, length, results, agree, refused))
  for method, converted_config, why in converted:
    for length in study.lengths:
      if why is not None:
        refused[(method, PROTOCOLS[0], length)] = why
      rows.append(
        _row(converted_config, folder.name, method, PROTOCOLS[0], CacheConfig(), length, results, agree, refused)
      )
  return rows


CONVERTED = "conversions.json"  # in a source's folder: each converted model's config, by method


def _converted(study: PressTableStudy, workdir: str, samples, done, folder, end, progress) -> tuple[list[dict], tuple]:
  """A converted model's full-cache answers on its source's samples at `lengths` (the records
  under method "heads:<workdir name>", in the source's folder) -> (its records, (method, its
  ModelConfig or None, why it is refused or None)). Its config is kept beside the records
  (CONVERTED), so that once every sample is answered the row stands without the checkpoint."""
  path = Path(workdir)
  method = f"{HEADS}{path.name}"
  mine = [s for s in samples if s["length"] in study.lengths]
  key = lambda s: (s["id"], method, PROTOCOLS[0])
  kept_path = folder / CONVERTED
  kept = json.loads(kept_path.read_text()) if kept_path.exists() else {}
  if latest_step(path) is None:
    found = [done[key(s)] for s in mine if key(s) in done]
    if method in kept and len(found) == len(mine):
      return found, (method, from_dict(ModelConfig, kept[method]), None)
    why = (
      f"PressTableStudy.conversions: no checkpoint in {workdir} (made by e.g. kvjax run configs/real_gqa/smollm2.py)"
    )
    return [], (method, None, why)
  model, params, tokenizer, _ = load(str(path))
  if not study.report_only:  # a report writes nothing
    config = json.loads(json.dumps(to_dict(model.config)))
    if kept.get(method) != config:
      kept_path.write_text(json.dumps(kept | {method: config}, indent=2) + "\n")
    _answer_by_sample(
      model, params, tokenizer, mine, [(method, PROTOCOLS[0], CacheConfig())], done, folder, end, progress
    )
  found = [done[key(s)] for s in mine if key(s) in done]
  return found, (method, model.config, None)


def _row(config, name, method, protocol, cache_config, length, results, agree, refused) -> dict:
  """One cell's row: its score (the mean over tasks), per task, bytes (None without the model's
  config), kvpress's agreement."""
  mine = [r for r in results if r["method"] == method and r["protocol"] == protocol and r["length"] == length]
  by_task: dict[str, list[float]] = {}
  for r in mine:
    by_task.setdefault(r["task"], []).append(r["score"])
  press, _, ratio = method.partition("@")
  peer = agree.get((method, protocol, length), {})
  return {
    "model": name,
    "press": press,
    "ratio": float(ratio) if ratio else 0.0,
    "protocol": protocol if cache_config.press is not None else "either",
    "length": length,
    "score": 100.0 * float(np.mean([np.mean(v) for v in by_task.values()])) if by_task else None,
    "kv_bytes_per_token": None if config is None else measure.kv_bytes_per_token(config, cache_config, length),
    "kvpress_same_score": peer.get("same_score"),
    "kvpress_same_answer": peer.get("same_answer"),
    "kvpress_samples": peer.get("samples"),
    "samples": len(mine),
    "refused": refused.get((method, protocol, length)),
    "refused_note": "refused" if (method, protocol, length) in refused else None,
    **{f"task_{t}": 100.0 * float(np.mean(v)) for t, v in by_task.items()},
  }


def _answer_by_sample(model, params, tokenizer, samples, todo, done, folder, end, progress) -> None:
  """Each sample's missing cells of `todo` answered together, per protocol (answer_cells); the
  records appended to folder/records.jsonl as each sample finishes."""
  for protocol in PROTOCOLS:
    wanted = [(n, c) for n, p, c in todo if p == protocol]
    for s in samples:
      missing = [(n, c) for n, c in wanted if (s["id"], n, protocol) not in done]
      if not missing:
        continue
      progress(f"press_table: {folder.name} {s['id']} {protocol}, {len(missing)} caches")
      start = time.perf_counter()
      found = answer_cells(model, params, tokenizer, s, [c for _, c in missing], protocol=protocol, end=end)
      seconds = time.perf_counter() - start
      found = [{**r, "method": n, "protocol": protocol, "answer_end": end} for (n, _), r in zip(missing, found)]
      _append(folder / "records.jsonl", found, done)
      compiled = sum(many.compilations().values())  # so far in this process: bounded, not per sample
      timing = {"id": s["id"], "protocol": protocol, "cells": len(found), "seconds": seconds, "compiled": compiled}
      _append(folder / "timing.jsonl", [timing])


def _answer_by_cell(model, params, tokenizer, samples, todo, done, folder, batch_size, end, progress) -> None:
  """Each missing cell of `todo` answered on its own over the samples (ruler.answer, batch_size
  at a time): a prefill and a decode loop per cell."""
  for name_, protocol, cache_config in todo:
    missing = [s for s in samples if (s["id"], name_, protocol) not in done]
    if not missing:
      continue
    progress(f"press_table: {folder.name} {name_} {protocol}, cell by cell")
    start = time.perf_counter()
    found = answer(model, params, tokenizer, missing, cache_config, protocol=protocol, batch_size=batch_size, end=end)
    seconds = time.perf_counter() - start
    found = [{**r, "method": name_, "protocol": protocol, "answer_end": end} for r in found]
    _append(folder / "records.jsonl", found, done)
    _append(folder / "timing.jsonl", [{"cell": name_, "protocol": protocol, "samples": len(found), "seconds": seconds}])


def _append(path: Path, records: list[dict], index: dict | None = None) -> None:
  """Records appended to a JSON-lines file (and entered in `index` by (id, method, protocol))."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  if index is not None:
    for r in records:
      index[(r["id"], r["method"], r["protocol"])] = r


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
    ("kvpress_samples", "samples kvpress answered", ""),
    ("refused_note", "refused (reason in press_table.json)", ""),
  ]
  table = report.write_table(rows, workdir / "press_table", columns)
  if any(r["score"] is not None for r in rows):
    figures(rows, workdir)
  (workdir / "press_table.md").write_text(
    f"Presses on the RULER-style suite: {study.samples} samples per task and length, tasks "
    f"{', '.join(study.tasks)}, seed {study.seed}\n\n{board(rows)}\n\nEvery cell:\n\n{table}\n"
  )
  return rows
