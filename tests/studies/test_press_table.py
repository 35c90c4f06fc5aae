"""The presses table (kvjax.studies.press_table): its cells, the bytes beside each score, a rerun
that reads finished cells back, and the per-sample agreement with a peer's answers."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from conftest import init_params, tiny_config

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig, cache_name
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies.base import measure
from kvjax.cache.kvzip import KVzip
from kvjax.conversion.conversions import KVHeads
from kvjax.studies.suite import ruler_answers
from kvjax.studies.suite.ruler_tasks import make_sample
from kvjax.studies.press_table import PressTableStudy, cells, press_cache, refusal, run
from kvjax.studies.base.scoring import read_jsonl, write_jsonl
from kvjax.training.checkpoint import load_model, save_params


@pytest.fixture(scope="module")
def table(smollm2, tmp_path_factory):
  study = PressTableStudy(
    sources=(str(smollm2),),
    lengths=(256,),
    tasks=("niah_single_1",),
    samples=2,
    presses=("snapkv",),
    ratios=(0.5,),
    protocols=("query_agnostic",),
    batch_size=2,
  )
  workdir = tmp_path_factory.mktemp("press_table")
  return study, workdir, run(study, workdir, lambda line: None)


@pytest.mark.tier2
def test_rows_hold_every_cell_with_its_bytes(table, smollm2):
  study, workdir, rows = table
  assert [(r["press"], r["ratio"], r["protocol"]) for r in rows] == [
    ("full", 0.0, "either"),
    ("snapkv", 0.5, "query_agnostic"),
  ]
  model, _, _ = load_model(smollm2)
  full = measure.kv_bytes_per_token(model.config, CacheConfig(), 256)
  assert rows[0]["kv_bytes_per_token"] == full
  assert rows[1]["kv_bytes_per_token"] == measure.kv_bytes_per_token(model.config, press_cache("snapkv", 0.5), 256)
  assert rows[1]["kv_bytes_per_token"] < 0.6 * full
  answers = read_jsonl(workdir / smollm2.name / "answers.jsonl")
  assert len(answers) == 4 and {a["method"] for a in answers} == {"full", "snapkv@0.5"}
  for row in rows:
    mine = [a["score"] for a in answers if a["method"] == ("full" if row["press"] == "full" else "snapkv@0.5")]
    assert row["score"] == pytest.approx(100 * sum(mine) / len(mine))
    assert row["kvpress_same_score"] is None  # no peer answers yet


@pytest.mark.tier2
def test_a_rerun_reads_finished_cells_and_scores_a_peer_sample_by_sample(table, smollm2):
  study, workdir, rows = table
  folder = workdir / smollm2.name
  cells = sorted((folder / "cells").iterdir())
  stamps = [c.stat().st_mtime_ns for c in cells]
  samples = read_jsonl(folder / "samples.jsonl")
  ours = {(a["id"], a["method"]): a for a in read_jsonl(folder / "answers.jsonl")}
  tokenizer = TextTokenizer.load(smollm2)
  assert all(s["stop_ids"] == list(tokenizer.stop_ids) for s in samples)
  # A peer that answers the reference for the first sample and nothing useful for the second.
  peer = []
  for method in ("full", "snapkv@0.5"):
    for i, s in enumerate(samples):
      ids = tokenizer.encode(" " + s["references"][0]).tolist() if i == 0 else tokenizer.encode(" no").tolist()
      peer.append({"id": s["id"], "method": method, "protocol": "query_agnostic", "answer_ids": ids})
  write_jsonl(folder / "kvpress.jsonl", peer)
  again = run(study, workdir, lambda line: None)
  assert [c.stat().st_mtime_ns for c in cells] == stamps  # read back, not answered again
  for row, method in zip(again, ("full", "snapkv@0.5")):
    same = [ours[(s["id"], method)]["score"] == (1.0 if i == 0 else 0.0) for i, s in enumerate(samples)]
    assert row["kvpress_same_score"] == pytest.approx(sum(same) / len(same))
    texts = [" " + samples[0]["references"][0], " no"]
    same_text = [ours[(s["id"], method)]["answer"] == texts[i] for i, s in enumerate(samples)]
    assert row["kvpress_same_answer"] == pytest.approx(sum(same_text) / len(same_text))


@pytest.mark.tier2
def test_one_prefill_per_sample_answers_as_cell_by_cell(table, tmp_path):
  study, workdir, rows = table
  alone = dataclasses.replace(study, shared_prefill=False)
  again = run(alone, tmp_path, lambda line: None)
  folder = [p for p in workdir.iterdir() if p.is_dir()][0].name
  shared = {(a["id"], a["method"], a["protocol"]): a["answer"] for a in read_jsonl(workdir / folder / "answers.jsonl")}
  by_cell = {
    (a["id"], a["method"], a["protocol"]): a["answer"] for a in read_jsonl(tmp_path / folder / "answers.jsonl")
  }
  assert len(shared) == 4 and shared == by_cell
  assert [r["score"] for r in again] == [r["score"] for r in rows]
  timing = read_jsonl(workdir / folder / "timing.jsonl")
  assert {t["id"] for t in timing} == {a[0] for a in shared} and all(t["cells"] == 2 for t in timing)
  compiled = [t["compiled"] for t in timing]  # the process's compiled functions as each sample ends
  assert compiled == sorted(compiled) and compiled[0] > 0


@pytest.mark.tier2
def test_a_converted_model_answers_through_its_full_cache_beside_its_source(table, smollm2, tmp_path):
  """conversions: SmolLM2 mean-pooled to one kv head, answered on its source's samples through its
  full cache as the cell-by-cell reference answers it, at its own bytes, in the source's rows; a
  workdir without a checkpoint is a refused row naming it."""
  study, finished, _ = table
  workdir = tmp_path / "table"
  shutil.copytree(finished, workdir)  # the table's cells read back, the conversion answered
  model, params, _ = load_model(smollm2)
  mqa_params, mqa_config = KVHeads(1, "mean").convert(params, model.config)
  mqa = tmp_path / "mqa"
  save_params(mqa, mqa_params, mqa_config)
  for f in smollm2.glob("tokenizer*.json"):
    shutil.copy(f, mqa / f.name)
  missing = str(tmp_path / "not_made")
  converted = dataclasses.replace(study, conversions=((str(smollm2), str(mqa)), (str(smollm2), missing)))
  rows = run(converted, workdir, lambda line: None)
  heads = [r for r in rows if r["press"] == "heads:mqa"]
  assert len(heads) == 1 and heads[0]["protocol"] == "either" and heads[0]["refused"] is None
  full = next(r for r in rows if r["press"] == "full")
  assert heads[0]["kv_bytes_per_token"] == measure.kv_bytes_per_token(mqa_config, CacheConfig(), 256)
  assert heads[0]["kv_bytes_per_token"] * 3 == pytest.approx(full["kv_bytes_per_token"], rel=1e-5)
  m, p, tokenizer, _ = ruler_answers.load(str(mqa))
  samples = read_jsonl(workdir / smollm2.name / "samples.jsonl")
  want = ruler_answers.answer(m, p, tokenizer, samples, CacheConfig(), batch_size=1)
  got = {a["id"]: a for a in read_jsonl(workdir / smollm2.name / "answers.jsonl") if a["method"] == "heads:mqa"}
  assert [got[w["id"]]["answer"] for w in want] == [w["answer"] for w in want]
  assert heads[0]["score"] == pytest.approx(100 * sum(w["score"] for w in want) / len(want))
  (refused,) = [r for r in rows if r["press"] == "heads:not_made"]
  assert refused["score"] is None and missing in refused["refused"]
  # Answered whole, the row stands on its records once the checkpoint is gone (the config kept
  # beside them); a conversion answered in part cannot finish without it and is refused.
  shutil.rmtree(mqa)
  again = run(dataclasses.replace(converted, report_only=True), workdir, lambda line: None)
  (kept,) = [r for r in again if r["press"] == "heads:mqa"]
  assert kept["refused"] is None and (kept["score"], kept["kv_bytes_per_token"]) == (
    heads[0]["score"],
    heads[0]["kv_bytes_per_token"],
  )
  records = read_jsonl(workdir / smollm2.name / "records.jsonl")
  first = next(r for r in records if r["method"] == "heads:mqa")
  write_jsonl(workdir / smollm2.name / "records.jsonl", [r for r in records if r["method"] != "heads:mqa"] + [first])
  (partial,) = [
    r
    for r in run(dataclasses.replace(converted, report_only=True), workdir, lambda line: None)
    if r["press"] == "heads:mqa"
  ]
  assert partial["score"] is None and str(mqa) in partial["refused"]


@pytest.mark.tier2
def test_cells_answered_in_parts_answer_as_in_one(smollm2):
  """answer_cells over parts of its configs (a memory limit that admits one cache at a time) gives
  the answers of one part holding them all: each cache is its own prefill's either way."""
  model, params, tokenizer, _ = ruler_answers.load(str(smollm2))
  sample = make_sample(tokenizer, "niah_single_1", 256, 0)
  configs = [press_cache("snapkv", 0.5), press_cache("knorm", 0.75), CacheConfig(dtype="int8"), CacheConfig()]
  whole = ruler_answers.answer_cells(model, params, tokenizer, sample, configs, memory_limit=2**40)
  parts = ruler_answers.answer_cells(model, params, tokenizer, sample, configs, memory_limit=1)
  assert [r["answer"] for r in parts] == [r["answer"] for r in whole]
  assert len(ruler_answers.cell_parts(model.config, configs, 300, 256, 1)) == len(configs)


@pytest.mark.tier2
def test_report_only_reads_the_records_and_answers_nothing(table, tmp_path):
  study, workdir, rows = table
  folder = [p for p in workdir.iterdir() if p.is_dir()][0]
  records = read_jsonl(folder / "records.jsonl")
  copy = tmp_path / folder.name
  write_jsonl(copy / "samples.jsonl", read_jsonl(folder / "samples.jsonl"))
  write_jsonl(copy / "records.jsonl", [r for r in records if r["method"] == "full"])  # one cell of two, so far
  partial = run(dataclasses.replace(study, report_only=True), tmp_path, lambda line: None)
  assert [r["samples"] for r in partial] == [2, 0] and partial[0]["score"] == rows[0]["score"]
  assert partial[1]["score"] is None and not (copy / "cells" / "snapkv@0.5_query_agnostic_256.jsonl").exists()


def test_cell_parts_keep_the_order_bound_each_part_and_keep_a_scorer_whole():
  config = tiny_config(2)
  configs = [CacheConfig(), press_cache("snapkv", 0.5), press_cache("snapkv", 0.75), CacheConfig(dtype="int8")] * 3
  size = [kinds.cache_bytes(config, c, 1, 64, prompt=48) for c in configs]
  pair = size[1] + size[2]  # SnapKV's two ratios: one scoring
  for limit in (1, max(size), pair, size[0] + pair, sum(size)):
    parts = ruler_answers.cell_parts(config, configs, 64, 48, limit)
    assert [c for part in parts for c in part] == configs
    held = [sum(kinds.cache_bytes(config, c, 1, 64, prompt=48) for c in part) for part in parts]
    assert all(h <= limit or len(p) == 1 for h, p in zip(held, parts))
    starts = [c for part in parts for c in part[:1]]
    if limit >= pair:  # the pair is never cut
      assert press_cache("snapkv", 0.75) not in starts
    # A part ends only when what comes next (the pair as a whole, or one cache) would not fit.
    for part, h, following in zip(parts, held, parts[1:]):
      nxt = following[0]
      whole = (
        pair
        if nxt == press_cache("snapkv", 0.5) and limit >= pair
        else kinds.cache_bytes(config, nxt, 1, 64, prompt=48)
      )
      assert h + whole > limit
  assert len(ruler_answers.cell_parts(config, configs, 64, 48, sum(size))) == 1


def test_codec_cells_and_names():
  assert cache_name(press_cache("snapkv+int8", 0.5)) == "snapkv+int8@0.5"
  assert (
    press_cache("full+int8", 0.0) == CacheConfig(dtype="int8") and cache_name(CacheConfig(dtype="int8")) == "full+int8"
  )
  study = PressTableStudy(presses=("snapkv",), ratios=(0.5,), codec_cells=(("full+int8", 0.0), ("snapkv+int8", 0.75)))
  names = [(m, p) for m, p, _ in cells(study)]
  assert ("full+int8", "query_agnostic") in names and ("full+int8", "query_aware") not in names
  assert ("snapkv+int8@0.75", "query_aware") in names
  long = [m for m, _, _ in cells(dataclasses.replace(study, long_ratios=(0.875,)), long=True)]
  assert long == ["full", "snapkv@0.875", "snapkv@0.875"]


def test_a_press_the_model_cannot_take_is_named_refused():
  config = tiny_config(2, window=(8, 0), max_len=256)
  model, _ = init_params(config)
  zipped = CacheConfig(press=KVzip(compression_ratio=0.5, repeat_ids=(5,), resume_ids=(6,)))
  assert "windowed" in refusal(model, zipped, 200)
  assert refusal(model, press_cache("snapkv", 0.5), 200) is None
  assert "always keeps" in refusal(model, press_cache("snapkv", 0.5), 100)  # fewer slots than its window


@pytest.mark.parametrize(
  "changes, field",
  [
    ({"presses": ("snapkv:per_head",)}, "suffix"),
    ({"presses": ("nope",)}, "nope"),
    ({"ratios": (1.0,)}, "ratios"),
    ({"protocols": ("both",)}, "protocols"),
    ({"sources": ()}, "sources"),
    ({"tasks": ("niah_single_9",)}, "niah_single_9"),
    ({"codec_cells": (("snapkv+int3", 0.5),)}, "dtype"),
    ({"codec_cells": ("snapkv",)}, "codec_cells"),
    ({"long": ((4096, "gemma3-270m"),)}, "long"),
    ({"long_ratios": (0.0,)}, "long_ratios"),
    ({"answer_end": "eos"}, "answer_end"),
    ({"conversions": (("gemma3-270m", "runs/mqa"),), "sources": ("smollm2-135m",)}, "conversions"),
    ({"conversions": ("runs/mqa",)}, "conversions"),
  ],
)
def test_bad_settings_are_refused_by_name(changes, field):
  with pytest.raises(ValueError, match=field):
    PressTableStudy(**changes)


def test_the_board_reads_the_rows_it_is_given():
  """The leaderboard from hand-made rows: a column per ratio, the protocols the rows hold, a
  refused cell named, one not answered "-"."""
  from kvjax.studies.parts.press_board import board

  def row(press, ratio, protocol, score, refused=None):
    return dict(model="m", length=1024, press=press, ratio=ratio, protocol=protocol, score=score, refused=refused)

  rows = [
    row("full", 0.0, "either", 45.06),
    row("snapkv", 0.5, "query_agnostic", 11.94),
    row("snapkv", 0.75, "query_agnostic", None),
    row("kvzip", 0.5, "query_agnostic", None, refused="windowed layers"),
    row("kvzip", 0.75, "query_agnostic", None, refused="windowed layers"),
  ]
  assert board(rows) == "\n".join(
    [
      "m, 1024 tokens, suite score % (query-agnostic):",
      "",
      "| press | 0.5 | 0.75 |",
      "|---|---|---|",
      "| full | 45.1 |  |",
      "| snapkv | 11.9 | - |",
      "| kvzip | refused | refused |",
    ]
  )
  both = rows + [row("snapkv", 0.5, "query_aware", 20.0)]
  assert "| snapkv | 11.9 / 20.0 | - / - |" in board(both)
  assert "(query-agnostic / query-aware)" in board(both)
