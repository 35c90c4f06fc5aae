"""The KV frontier study end to end on its tiny toy config, reading the tiny GQA table's models
(the gqa_tiny fixture), against the plain evaluation of the same models; and the checks of its
variants."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cache.kinds import bytes_per_token
from kvjax.cli.main import main as kvjax_main
from kvjax.cli.run import load_config
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.fields import apply_overrides
from kvjax.studies import kv_frontier as kvf
from kvjax.studies.parts import kv_frontier_report as kvf_report
from kvjax.studies.parts import toy_kv
from kvjax.studies.base.variants import FAMILIES, Variant
from kvjax.training.evaluate import evaluate_checkpoint
from kvjax.training.workdir import claim_study
from conftest import tree_state

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/kv_frontier/tiny.py"
MLA = "MLA 32+32+distill1"


@pytest.fixture(scope="module")
def frontier(gqa_tiny, tmp_path_factory):
  """configs/kv_frontier/tiny.py on the tiny GQA table's models (models_from), its variants given
  again by --set (a tuple of Variants, each with its CacheConfig and conversion, read back from
  dicts); the GQA table's workdir is left as it was."""
  study = load_config(TINY)
  variants = f"variants={[dataclasses.asdict(v) for v in study.variants]!r}"
  study = apply_overrides(study, [variants, f"models_from={str(gqa_tiny)!r}"])
  workdir = tmp_path_factory.mktemp("kv_frontier_tiny")
  before = tree_state(gqa_tiny)
  progress = []
  with claim_study(workdir, study):
    rows = kvf.run(study, workdir, progress.append)
  assert tree_state(gqa_tiny) == before and not (workdir / "mha_big").exists()
  assert progress[-1] == "kv_frontier: timing the decode step of every variant"
  assert json.loads((workdir / "kv_frontier.json").read_text()) == rows
  return study, workdir, rows


@pytest.mark.tier2
def test_tiny_study_writes_a_row_per_variant_and_the_columns_asked_for(frontier):
  study, workdir, rows = frontier
  names = [v.name for v in study.variants]
  assert {
    "fp32",
    "bf16",
    "GQA-2 mean",
    "GQA-2 pca+distill1",
    "MQA mean",
    "MQA pca+distill1",
    "window 16",
    "window 16 + 2 sinks",
    MLA,
  } <= set(names)
  with open(workdir / "kv_frontier.csv") as f:
    table = list(csv.DictReader(f))
  assert [r["variant"] for r in table] == names
  assert list(table[0]) == [key for key, _, _ in kvf_report.csv_columns(study)]
  assert {"recall_24", "recall_40", "recall_bytes_24", "recall_bytes_40"} <= set(table[0])
  assert [r["variant"] for r in rows] == names
  text = (workdir / "kv_frontier.md").read_text()
  assert all(f"| {name} |" in text for name in names) and "recall @40" in text
  assert (workdir / "kv_frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for row in rows:
    assert 0 < row["bits_per_byte"] < 8 and 0 < row["decode_bits_per_byte"] < 8 and row["decode_step_ms"] > 0
    assert all(0 <= row[f"recall_{d}"] <= row[f"recall_bytes_{d}"] <= 1 for d in study.measure.recall.distances)
    # One record per needle: exact match and byte accuracy are their means.
    for d in study.measure.recall.distances:
      samples = [s for s in row["samples"] if s["distance"] == d]
      assert len(samples) == study.measure.recall.needles
      assert row[f"recall_{d}"] == sum(s["answer"] == s["needle"] for s in samples) / len(samples)
  # The fewest bytes per token cannot be beaten on bytes: the better MQA row is on the front.
  assert min(rows, key=lambda r: (r["kv_bytes_per_token"], r["bits_per_byte"]))["pareto"]


@pytest.mark.tier2
def test_float32_cache_matches_the_plain_evaluation_and_bytes_are_exact(frontier):
  study, workdir, rows = frontier
  by_name = {r["variant"]: r for r in rows}
  fp32, big, m = by_name["fp32"], study.gqa.big, study.measure
  source = Path(study.models_from)
  plain = evaluate_checkpoint(source / "mha_big", batch_size=m.eval_batch_size, num_batches=m.eval_batches)
  # Oracle: a float32 cache stores the values as computed, so through it (prefill, and decode
  # step by step) the held-out bits per byte are kvjax eval's.
  assert fp32["bits_per_byte"] == pytest.approx(plain["bits_per_byte"], rel=1e-5)
  assert fp32["decode_bits_per_byte"] == pytest.approx(plain["bits_per_byte"], rel=1e-4)
  assert fp32["plain_bits_per_byte"] == pytest.approx(plain["bits_per_byte"], rel=1e-6)
  for row in rows:
    if row["cache_dtype"] == "float32" and row["family"] != "window":
      assert row["bits_per_byte"] == pytest.approx(row["plain_bits_per_byte"], rel=1e-5)
    if row["family"] == "window":
      # Oracle: decoding through the ring buffer sees what one prefill under the window's mask sees.
      assert row["decode_bits_per_byte"] == pytest.approx(row["bits_per_byte"], rel=1e-4)
      cache = next(v for v in study.variants if v.name == row["variant"]).cache
      slots = min(m.context, cache.window[0] + (cache.sink_tokens or 0))
      assert row["kv_bytes_per_token"] == (bytes_per_token(big) * slots + 4) / m.context
  assert by_name["bf16"]["decode_bits_per_byte"] == pytest.approx(fp32["decode_bits_per_byte"], rel=1e-2)
  # Every byte per token at 128 positions carries the row's int32 length: 4 / 128.
  assert m.context == 128 and fp32["kv_bytes_per_token"] == bytes_per_token(big) + 4 / 128 == 1024 + 1 / 32
  # 2 (K, V) x layers x kv heads x (head_dim + one float32 scale) bytes
  assert by_name["int8"]["kv_bytes_per_token"] == 2 * big.num_layers * big.num_kv_heads * (big.head_dim + 4) + 1 / 32
  assert by_name["bf16"]["kv_bytes_per_token"] == 512 + 1 / 32
  assert by_name["GQA-2 mean"]["kv_bytes_per_token"] == 1024 * 2 / 16 + 1 / 32
  assert by_name["MQA pca+distill1"]["kv_bytes_per_token"] == 1024 / 16 + 1 / 32
  mla = by_name[MLA]
  # MLA at the bytes of 8 kv heads: 2 layers x (latent 32 + 32 rotary dims) x 4 bytes.
  assert mla["kv_bytes_per_token"] == 2 * (32 + 32) * 4 + 1 / 32 == 1024 * 8 / 16 + 1 / 32
  assert (mla["kv_latent_rank"], mla["rope_dims"], mla["params"]) == (32, 32, "mla_r32_rope32_alpha0.1_distill1")
  # Oracle: decoding reads the latent cache absorbed, the prefill expanded; the two agree.
  assert mla["decode_bits_per_byte"] == pytest.approx(mla["bits_per_byte"], rel=1e-4)
  # The same uptraining as the heads family's best rows: alpha and distillation.
  gqa_run = json.loads((source / "kv2_pca_alpha0.1_distill1" / "uptrain.json").read_text())
  mla_run = json.loads((source / mla["params"] / "uptrain.json").read_text())
  assert mla_run["conversion"] == {"kv_latent_rank": 32, "rope_dims": 32, "factorisation": "activation"}
  assert {k: mla_run[k] for k in ("fraction", "distill", "steps", "source_step")} == {
    k: gqa_run[k] for k in ("fraction", "distill", "steps", "source_step")
  }


@pytest.mark.tier2
def test_kvjax_eval_recall_scores_as_the_study_does(frontier, capsys):
  study, workdir, rows = frontier
  rc, big = study.measure.recall, Path(study.models_from) / "mha_big"
  capsys.readouterr()
  assert (
    kvjax_main(
      [
        "eval",
        "--workdir",
        str(big),
        "--recall",
        ",".join(map(str, rc.distances)),
        "--needles",
        str(rc.needles),
        "--needle-bytes",
        str(rc.needle_bytes),
      ]
    )
    == 0
  )
  result = json.loads(capsys.readouterr().out)
  fp32 = rows[[r["variant"] for r in rows].index("fp32")]
  for d in rc.distances:
    assert result["recall"][str(d)]["exact_match"] == fp32[f"recall_{d}"]
    assert result["recall"][str(d)]["byte_accuracy"] == fp32[f"recall_bytes_{d}"]
  assert kvjax_main(["eval", "--workdir", str(big), "--recall", "4"]) == 2
  assert "below 24" in capsys.readouterr().err
  assert kvjax_main(["eval", "--workdir", str(big), "--recall", "24", "--batches", "2"]) == 2
  assert "--batches" in capsys.readouterr().err


@pytest.mark.tier2
def test_models_from_a_study_with_other_settings_or_unfinished_is_refused(frontier, tmp_path):
  study, _, _ = frontier
  other = dataclasses.replace(study.gqa, fraction=0.2)
  with pytest.raises(ValueError, match=r"other settings.*fraction: 0.1 -> 0.2"):
    toy_kv.prepare(other, study.variants, tmp_path, study.models_from)
  missing = (Variant("GQA-4", "heads", conversion=KVHeads(4), recovered=True),)
  with pytest.raises(ValueError, match=r"has not finished \['kv4_mean_alpha0.1'\]"):
    toy_kv.prepare(study.gqa, missing, tmp_path, study.models_from)
  with pytest.raises(ValueError, match="is not a GQA study's workdir"):
    toy_kv.prepare(study.gqa, missing, tmp_path, str(tmp_path / "nothing"))


def test_a_variant_this_kvjax_lacks_is_refused_up_front():
  study = load_config(TINY)
  with pytest.raises(
    ValueError,
    match=r"variant 'ring' \(window=\(4096,\)\) cannot decode its model: .*window\[0\]=4096 "
    "is larger than max_len=128",
  ):
    dataclasses.replace(study, variants=study.variants[:1] + (Variant("ring", "window", CacheConfig(window=(4096,))),))
  odd = dataclasses.replace(study.gqa.big, head_dim=9, positions="learned")
  with pytest.raises(ValueError, match=r"variant 'int4' \(dtype=int4\) cannot decode its model: an int4 cache packs"):
    kvf.check_cache(odd, Variant("int4", "codec", CacheConfig(dtype="int4")))


def test_bad_study_configs_name_the_field():
  study = load_config(TINY)
  with pytest.raises(ValueError, match="names must be distinct"):
    dataclasses.replace(study, variants=study.variants[:1] * 2)
  with pytest.raises(
    ValueError,
    match=r"Variant 'GQA-3': kv3_mean does not convert MHA-big: KVHeads.num_kv_heads=3: "
    "cannot convert 16 kv heads to 3",
  ):
    dataclasses.replace(study, variants=(Variant("GQA-3", "heads", conversion=KVHeads(3), recovered=True),))
  with pytest.raises(ValueError, match="a toy study's conversions are uptrained at alpha = gqa.fraction"):
    dataclasses.replace(study, variants=(Variant("GQA-2", "heads", conversion=KVHeads(2)),))
  with pytest.raises(ValueError, match=r"Variant 'x': cache must be a CacheConfig, got \{'num_kv_heads': 2\}"):
    Variant("x", "window", {"num_kv_heads": 2})
  with pytest.raises(ValueError, match="Variant 'x': family must be one of"):
    Variant("x", "pruning")
  with pytest.raises(
    ValueError, match="family 'mla' runs params converted by a conversion of that kind, got conversion=None"
  ):
    Variant("x", "mla")
  with pytest.raises(ValueError, match="family 'heads' .* got conversion=mla_r32_rope32"):
    Variant("x", "heads", conversion=ToMLA(32, 32))
  with pytest.raises(ValueError, match="distill=1.0 needs a conversion to uptrain"):
    Variant("x", "window", CacheConfig(window=(16,)), distill=1.0)
  with pytest.raises(ValueError, match="recovered=True needs a conversion"):
    Variant("x", "window", recovered=True)
  with pytest.raises(ValueError, match="rope_dims=8 must be a multiple of 2 x num_kv_heads=32"):
    dataclasses.replace(study, variants=(Variant("x", "mla", conversion=ToMLA(8, 8), recovered=True),))
  with pytest.raises(ValueError, match="rope_dims=32 leaves no latent at the bytes of 2 kv heads"):
    ToMLA.at_kv_heads(study.gqa.big, 2, 32)
  # A cache change on converted params is a point of its own family.
  windowed = Variant("GQA-2 window 16", "window", CacheConfig(window=(16,)), conversion=KVHeads(2), recovered=True)
  assert dataclasses.replace(study, variants=(windowed,)).folder(windowed) == "kv2_mean_alpha0.1"
  with pytest.raises(ValueError, match="context=4096 exceeds MHA-big's max_len=128"):
    dataclasses.replace(study, measure=dataclasses.replace(study.measure, context=4096))
  with pytest.raises(ValueError, match="distance 200 needs"):
    dataclasses.replace(
      study,
      measure=dataclasses.replace(study.measure, recall=dataclasses.replace(study.measure.recall, distances=(200,))),
    )
  with pytest.raises(ValueError, match="needs one model: gqa .* or source"):
    dataclasses.replace(study, source="smollm2-135m")
  with pytest.raises(ValueError, match="KVFrontierStudy.measure must be a ToyMeasure for a toy model"):
    kvf.KVFrontierStudy(gqa=study.gqa, variants=study.variants, measure=kvf.Measure())
  cpu = load_config(ROOT / "configs/kv_frontier/cpu.py")
  assert cpu.measure.context == 2048 and {v.family for v in cpu.variants} == {"codec", "heads", "window", "mla"}
  assert set(FAMILIES) >= {v.family for v in cpu.variants}
