"""The real-model studies end to end on the first 2 layers of SmolLM2-135M-Instruct: the GQA table
(configs/real_gqa/smollm2_tiny.py) makes every model, the frontier (configs/kv_frontier/
smollm2_tiny.py) reads them from its workdir; the rows are checked against oracles."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cli.run import load_config
from kvjax.config import ModelConfig
from kvjax.studies import kv_frontier, real_gqa
from kvjax.studies.parts import real_kv
from kvjax.studies.base import scoring
from kvjax.studies.kv_frontier import KVFrontierStudy
from kvjax.studies.parts.real_kv import Recovery
from kvjax.studies.base.scoring import read_jsonl
from kvjax.studies.suite.axis import SuiteConfig
from kvjax.studies.base.variants import Variant
from kvjax.training.workdir import claim_study

CONFIGS = Path(__file__).parents[2] / "configs"


def run(module, study, workdir: Path) -> list[dict]:
  with claim_study(workdir, study):
    return module.run(study, workdir, lambda line: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("real")
  table = run(real_gqa, load_config(CONFIGS / "real_gqa" / "smollm2_tiny.py"), root / "gqa")
  # The peer path with a cheap stand-in for Gemma 3: the GQA table's own import, read as it is.
  study = dataclasses.replace(
    load_config(CONFIGS / "kv_frontier" / "smollm2_tiny.py"),
    models_from=str(root / "gqa"),
    peers=(str(root / "gqa" / "source"),),
  )
  rows = run(kv_frontier, study, root / "frontier")
  assert json.loads((root / "gqa" / "real_gqa.json").read_text()) == table
  assert json.loads((root / "frontier" / "kv_frontier.json").read_text()) == rows
  return root, table, {r["variant"]: r for r in rows}


def test_gap_closed_by_hand():
  # Halfway from ln 4 to ln 1 in log perplexity is ln 2; past the goal is more than all of it.
  assert real_gqa.gap_closed(math.log(2), math.log(4), math.log(1)) == pytest.approx(0.5)
  assert real_gqa.gap_closed(math.log(4), math.log(4), math.log(2)) == 0.0
  assert real_gqa.gap_closed(math.log(1), math.log(4), math.log(2)) == pytest.approx(2.0)
  assert real_gqa.gap_closed(1.0, 3.0, 3.0) is None


@pytest.mark.tier2
def test_the_gqa_table_rows_and_files(runs):
  root, table, _ = runs
  assert [r["model"] for r in table] == [
    "as shipped (GQA-3)",
    "MQA mean, alpha 0",
    "MQA mean + local recovery",
    "MQA pca + local recovery",
    "MLA 104+24 (MQA bytes) + local recovery",
    "MQA mean + local recovery + distillation (2 steps)",
    "MQA pca + local recovery + distillation (2 steps)",
    "MLA 104+24 (MQA bytes) + local recovery + distillation (2 steps)",
  ]
  # The gap each recovered row closes, from its own perplexity and the two rows that bound it.
  ln = [math.log(r["perplexity_128"]) for r in table]
  for row, value in zip(table[2:], ln[2:]):
    assert row["gap_closed"] == pytest.approx((ln[1] - value) / (ln[1] - ln[0]), rel=1e-9)
  # 2 layers x (K + V) x kv heads x 64 dims x 4 bytes, and the row's int32 length over 2,048
  # positions; MLA at MQA's bytes exactly.
  assert [r["kv_bytes_per_token"] for r in table] == [3072 + 4 / 2048] + [1024 + 4 / 2048] * 7
  for row in table:
    assert row["time_per_sample_s"] > 0 and math.isfinite(row["perplexity_128"])
    assert [s["length"] for s in row["samples"]] == [160, 160, 128, 128] and all(
      s["method"] == row["model"] for s in row["samples"]
    )
    suite, keys = row["samples"][:2], row["samples"][2:]
    assert all(0 < s["distance"] < 128 and 0 <= s["depth"] <= 1 for s in keys)
    # The suite's columns from its per-sample scores, the pass key's from its hits.
    assert row["suite_160"] == row["suite_mean"] == pytest.approx(100 * (suite[0]["score"] + suite[1]["score"]) / 2)
    assert row["passkey_128"] == row["passkey_mean"] == 100 * (keys[0]["hit"] + keys[1]["hit"]) / 2
  # Each row's measurements are a stage of their own: a rerun resumes after the last row measured.
  done = json.loads((root / "gqa" / "stages.json").read_text())
  added = ("params", "time_per_sample_s", "times_s", "gap_closed")
  assert [v for k, v in done.items() if k.startswith("measured ")] == [
    {k: v for k, v in row.items() if k not in added} for row in table
  ]
  # Per-sample records as JSON lines: the inputs once, every row's answers.
  inputs = read_jsonl(root / "gqa" / "samples.jsonl")
  assert [s["id"] for s in inputs] == [
    "niah_single_1/160/0",
    "niah_single_1/160/1",
    "passkey/128/0",
    "passkey/128/1",
  ]
  assert [len(s["context_ids"]) + len(s["question_ids"]) for s in inputs] == [160, 160, 128, 128]
  answers = read_jsonl(root / "gqa" / "answers.jsonl")
  assert answers == [s for row in table for s in row["samples"]]
  for a in answers[:2]:
    truth = next(s for s in inputs if s["id"] == a["id"])
    assert a["score"] == scoring.score(a["answer"], truth["references"])
  text = (root / "gqa" / "real_gqa.md").read_text()
  assert "suite % @160" in text and "pass key % @128" in text and "niah_single_1" in text
  for name in ("real_gqa.md", "real_gqa.csv", "real_gqa.png"):
    assert (root / "gqa" / name).stat().st_size > 0
  assert "Gap closed" in text
  for folder in ("kv1_mean_local", "kv1_pca_local", "mla_r104_rope24_local"):
    record = json.loads((root / "gqa" / folder / "uptrain.json").read_text())
    assert record["recovery"] == "local" and len(record["layers"]) == 2
    assert all(layer["loss_after"] <= layer["loss_before"] for layer in record["layers"])
  # A recovered row runs the recovered params: not the alpha = 0 ones.
  assert table[2]["perplexity_128"] != table[1]["perplexity_128"]
  # Each distilled row trained end to end from its layer-local recovery; its curve starts there.
  curves = json.loads((root / "gqa" / "gap_closed_vs_steps.json").read_text())
  for row, local in zip(table[5:], ("kv1_mean_local", "kv1_pca_local", "mla_r104_rope24_local")):
    assert row["params"] == f"{local}_distill"
    record = json.loads((root / "gqa" / row["params"] / "uptrain.json").read_text())
    recovered = json.loads((root / "gqa" / local / "uptrain.json").read_text())
    assert record["init"]["path"] == str(root / "gqa" / local) and record["recovered"] == recovered["after"]
    start, goal = record["converted"]["loss"], record["before"]["loss"]
    assert [p["step"] for p in record["curve"]] == [0, 2]
    assert record["curve"][0]["gap_closed"] == pytest.approx((start - recovered["after"]["loss"]) / (start - goal))
    assert [c for c in curves if c["model"] == row["model"]] == [{"model": row["model"], **p} for p in record["curve"]]
  for name in ("gap_closed_vs_steps.md", "gap_closed_vs_steps.csv", "gap_closed_vs_steps.png"):
    assert (root / "gqa" / name).stat().st_size > 0


def continuation_perplexity(model, params, windows) -> float:
  """The oracle: a plain causal forward over each whole window, its second half scored."""
  total = count = 0
  for inputs, targets in windows:
    half = inputs.shape[1] // 2
    logits = model.apply({"params": params}, inputs)
    nll = -jax.nn.log_softmax(logits, axis=-1)[:, half:]
    total += float(np.take_along_axis(np.asarray(nll), targets[:, half:, None].astype(np.int64), axis=-1).sum())
    count += targets[:, half:].size
  return math.exp(total / count)


@pytest.mark.tier2
def test_the_frontier_rows_against_oracles(runs):
  root, table, rows = runs
  study = load_config(CONFIGS / "kv_frontier" / "smollm2_tiny.py")
  assert list(rows) == [v.name for v in study.variants] + ["source"]
  # The peer, measured as trained: the very model of "full cache", so the very numbers, its own
  # family and (its own import) no conversion; its records marked with its name.
  peer, full = rows.pop("source"), rows["full cache"]
  assert peer["family"] == "GQA-3 as trained" and peer["params"] == "peer_source"
  for key in ("kv_bytes_per_token", "perplexity_128", "suite_160", "suite_mean"):
    assert peer[key] == full[key], key
  assert [s["answer"] for s in peer["samples"]] == [s["answer"] for s in full["samples"]]
  assert all(s["method"] == "source" and s["model"] == "source" for s in peer["samples"])
  # Models the GQA table made are read from its workdir; the frontier made the one it lacked.
  assert not (root / "frontier" / "source").exists() and not (root / "frontier" / "kv1_pca_local").exists()
  assert json.loads((root / "frontier" / "kv1_pca_alpha0" / "uptrain.json").read_text())["source"] == str(
    root / "gqa" / "source"
  )
  model, params, tokenizer = real_kv.load(root / "gqa" / "source")
  windows = real_kv.prose_windows(tokenizer, 128, 1)
  np.testing.assert_allclose(
    rows["full cache"]["perplexity_128"], continuation_perplexity(model, params, windows), rtol=1e-4
  )
  # The same params through the same cache in both studies: the same numbers.
  assert rows["full cache"]["perplexity_128"] == pytest.approx(table[0]["perplexity_128"], rel=1e-6)
  assert rows["MQA mean"]["perplexity_128"] == pytest.approx(table[1]["perplexity_128"], rel=1e-6)
  assert rows["MQA pca + recovery"]["perplexity_128"] == pytest.approx(table[3]["perplexity_128"], rel=1e-6)
  # Bytes per token by hand: int8 stores 64 bytes + a 4-byte scale per head vector; a window of
  # 32 (+ 4 sinks) holds 32 (36) of the 128 positions; SnapKV at 0.5 keeps 64 slots of 128 with
  # 8 bytes of position and score each per kv head; every one with the row's int32 length.
  length = 4 / 128
  assert rows["int8"]["kv_bytes_per_token"] == 2 * 2 * 3 * 68 + length
  assert rows["window 32"]["kv_bytes_per_token"] == 3072 * 32 / 128 + length
  assert rows["window 32 + 4 sinks"]["kv_bytes_per_token"] == 3072 * 36 / 128 + length
  assert rows["snapkv 0.5"]["kv_bytes_per_token"] == (3072 + 2 * 3 * 8) * 64 / 128 + length
  assert rows["int8 + snapkv 0.5"]["kv_bytes_per_token"] == (816 + 2 * 3 * 8) * 64 / 128 + length
  # What a cache drops changes the numbers.
  assert rows["window 32"]["perplexity_128"] != rows["full cache"]["perplexity_128"]
  # The fewest bytes per token cannot be beaten on bytes: int8 + SnapKV is on both fronts.
  assert min(rows.values(), key=lambda r: r["kv_bytes_per_token"])["variant"] == "int8 + snapkv 0.5"
  assert rows["int8 + snapkv 0.5"]["pareto_perplexity"] and rows["int8 + snapkv 0.5"]["pareto_recall"]
  for name in ("kv_frontier.md", "kv_frontier.csv", "kv_frontier_perplexity.png", "kv_frontier_recall.png"):
    assert (root / "frontier" / name).stat().st_size > 0
  assert "suite % @160" in (root / "frontier" / "kv_frontier.md").read_text()
  # The GQA table's suite samples (one tokenizer, one seed), then the peer's marked with its name;
  # every variant's answers, then the peer's.
  inputs = read_jsonl(root / "frontier" / "samples.jsonl")
  assert inputs[:2] == read_jsonl(root / "gqa" / "samples.jsonl")[:2]
  assert inputs[2:] == [{**s, "model": "source"} for s in inputs[:2]]
  answers = read_jsonl(root / "frontier" / "answers.jsonl")
  assert [a["method"] for a in answers] == [name for name in [*rows, "source"] for _ in range(2)]
  assert [a for a in answers if a["method"] == "full cache"] == rows["full cache"]["samples"]
  for row in rows.values():
    assert row["suite_mean"] == pytest.approx(100 * sum(s["score"] for s in row["samples"]) / 2)
  # The front of recall is on the suite's mean: a row that scores more at no more bytes beats it.
  best = max(rows.values(), key=lambda r: (r["suite_mean"], -r["kv_bytes_per_token"]))
  assert best["pareto_recall"]


@pytest.mark.tier2
def test_models_from_a_study_with_other_settings_is_refused(runs, tmp_path):
  root, _, _ = runs
  full = [Variant("full", "full")]
  with pytest.raises(ValueError, match="other settings.*recovery.steps: 3 -> 4"):
    real_kv.prepare(
      "smollm2-135m",
      2,
      Recovery(
        steps=4, batch_size=2, seq_len=32, data_bytes=200_000, windows=32, distill_steps=2, distill_eval_every=2
      ),
      full,
      tmp_path,
      str(root / "gqa"),
    )
  with pytest.raises(ValueError, match="not a real-model study's workdir"):
    real_kv.prepare("smollm2-135m", 2, Recovery(), full, tmp_path, str(tmp_path / "nothing"))


def test_bad_variants_are_refused():
  with pytest.raises(ValueError, match="family"):
    Variant("x", "quantum")
  with pytest.raises(ValueError, match="names must be distinct"):
    KVFrontierStudy(source="x", variants=(Variant("a", "full"), Variant("a", "codec", CacheConfig(dtype="int8"))))
  with pytest.raises(ValueError, match="KVFrontierStudy.variants must be a non-empty tuple"):
    KVFrontierStudy(source="x")
  with pytest.raises(ValueError, match="KVFrontierStudy.measure must be a Measure for a pretrained model"):
    KVFrontierStudy(source="x", variants=(Variant("a", "full"),), measure=kv_frontier.ToyMeasure())
  with pytest.raises(ValueError, match="Recovery.mode"):
    Recovery(mode="none")
  with pytest.raises(ValueError, match="Recovery.distill_steps=5 trains end to end after a layer-local recovery"):
    Recovery(mode="train", distill_steps=5)


def test_settings_recorded_before_distillation_read_back():
  """A stages.json written before Recovery had its distill_* fields reads as their defaults (0
  steps: no distilled rows), so its models are reused; other values are a real change."""
  recovery = Recovery(steps=4)
  old = real_kv.stage_settings("smollm2-135m", 2, recovery)
  for key in ("distill_steps", "distill_lr", "distill_eval_every"):
    del old["recovery"][key]
  assert real_kv.read_back(old) == real_kv.stage_settings("smollm2-135m", 2, recovery)
  distilled = real_kv.stage_settings("smollm2-135m", 2, dataclasses.replace(recovery, distill_steps=2))
  assert real_kv.read_back(old) != distilled


def test_bad_suite_and_peer_settings_name_the_field():
  with pytest.raises(ValueError, match="SuiteConfig.protocol must be one of"):
    SuiteConfig(protocol="both")
  with pytest.raises(ValueError, match="SuiteConfig: .*niah_single_9"):
    SuiteConfig(tasks=("niah_single_9",))
  with pytest.raises(ValueError, match="SuiteConfig.samples"):
    SuiteConfig(samples=0)
  with pytest.raises(ValueError, match="Measure.suite must be a SuiteConfig"):
    real_kv.Measure(suite=(1024,))
  with pytest.raises(ValueError, match="Measure.passkey must be a PasskeyConfig or None"):
    real_kv.Measure(passkey=512)
  full = (Variant("full", "full"),)
  with pytest.raises(ValueError, match="KVFrontierStudy.peers must name distinct models"):
    KVFrontierStudy(source="x", variants=full, peers=("gemma3-270m", "runs/a/gemma3-270m"))
  with pytest.raises(ValueError, match="KVFrontierStudy.peers must be a tuple"):
    KVFrontierStudy(source="x", variants=full, peers="gemma3-270m")
  with pytest.raises(ValueError, match="share a name with a variant"):
    KVFrontierStudy(source="x", variants=full, peers=("runs/full",))
  with pytest.raises(ValueError, match="RealGqaStudy.peers must be a tuple"):
    real_gqa.RealGqaStudy(peers=("",))
  with pytest.raises(ValueError, match="RealGqaStudy.distilled must be a tuple of recovered rows"):
    real_gqa.RealGqaStudy(distilled=("pca",))


def test_distilled_picks_the_recovered_rows_that_train_end_to_end():
  recovery = real_kv.Recovery(distill_steps=8)
  names = lambda study: [v.name for v in study.variants(3) if v.distill]  # noqa: E731
  assert len(names(real_gqa.RealGqaStudy(recovery=recovery))) == 3
  assert names(real_gqa.RealGqaStudy(recovery=recovery, distilled=("best",))) == [
    "MQA pca + local recovery + distillation (8 steps)"
  ]
  assert names(real_gqa.RealGqaStudy(distilled=("best",))) == []  # no distill_steps: none


def test_a_peer_is_named_for_its_attention():
  config = ModelConfig(d_model=64, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=16, vocab_size=8, max_len=8)
  assert real_kv.attention_kind(config) == "MQA"
  assert real_kv.attention_kind(dataclasses.replace(config, num_kv_heads=2)) == "GQA-2"
  assert real_kv.attention_kind(dataclasses.replace(config, num_kv_heads=4)) == "MHA"
  assert [real_kv.peer_name(p) for p in ("gemma3-270m", "models/gemma-3.gguf", "runs/x/source")] == [
    "gemma3-270m",
    "gemma-3",
    "source",
  ]
