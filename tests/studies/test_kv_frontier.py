"""The KV frontier study end to end on its tiny config, against the plain evaluation of the same
models; reuse of a finished study's models; and the checks of its variants."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cache.kinds import bytes_per_token
from kvjax.cli.main import main as kvjax_main
from kvjax.cli.run import load_config
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.studies import kv_frontier as kvf
from kvjax.studies import kv_frontier_report as kvf_report
from kvjax.training.evaluate import evaluate_checkpoint
from kvjax.training.workdir import claim_study

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/kv_frontier/tiny.py"
MLA = "MLA 32+32+distill1"


def driver():
  spec = importlib.util.spec_from_file_location("kv_frontier_driver", ROOT / "experiments/kv_frontier.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


def tree_state(path: Path) -> dict:
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def frontier(tmp_path_factory):
  """`kvjax run configs/kv_frontier/tiny.py`, its variants given again by --set (a tuple of
  Variants, each with its CacheConfig and conversion, read back from dicts)."""
  study = load_config(TINY)
  workdir = tmp_path_factory.mktemp("kv_frontier_tiny")
  variants = f"variants={[dataclasses.asdict(v) for v in study.variants]!r}"
  assert kvjax_main(["run", str(TINY), "--workdir", str(workdir), "--set", variants]) == 0
  return study, workdir, json.loads((workdir / "kv_frontier.json").read_text())


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
  assert json.loads((workdir / "config.json").read_text())["variants"][0]["name"] == names[0]
  text = (workdir / "kv_frontier.md").read_text()
  assert all(f"| {name} |" in text for name in names) and "recall @40" in text
  assert (workdir / "kv_frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for row in rows:
    assert 0 < row["bits_per_byte"] < 8 and 0 < row["decode_bits_per_byte"] < 8 and row["decode_step_ms"] > 0
    assert all(0 <= row[f"recall_{d}"] <= row[f"recall_bytes_{d}"] <= 1 for d in study.recall.distances)
  assert [r["pareto"] for r in rows] == kvf.pareto(rows, "kv_bytes_per_token", "bits_per_byte")


def test_float32_cache_matches_the_plain_evaluation_and_bytes_are_exact(frontier):
  study, workdir, rows = frontier
  by_name = {r["variant"]: r for r in rows}
  fp32, big = by_name["fp32"], study.gqa.big
  plain = evaluate_checkpoint(workdir / "mha_big", batch_size=study.eval_batch_size, num_batches=study.eval_batches)
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
      slots = min(study.context, cache.window[0] + (cache.sink_tokens or 0))
      assert row["kv_bytes_per_token"] == bytes_per_token(big) * slots / study.context
  assert by_name["bf16"]["decode_bits_per_byte"] == pytest.approx(fp32["decode_bits_per_byte"], rel=1e-2)
  assert fp32["kv_bytes_per_token"] == bytes_per_token(big)
  # 2 (K, V) x layers x kv heads x (head_dim + one float32 scale) bytes
  assert by_name["int8"]["kv_bytes_per_token"] == 2 * big.num_layers * big.num_kv_heads * (big.head_dim + 4)
  assert by_name["bf16"]["kv_bytes_per_token"] == bytes_per_token(big) / 2
  assert by_name["GQA-2 mean"]["kv_bytes_per_token"] == bytes_per_token(big) * 2 / big.num_heads
  assert by_name["MQA pca+distill1"]["kv_bytes_per_token"] == bytes_per_token(big) / big.num_heads
  mla = by_name[MLA]
  # MLA at the bytes of 8 kv heads: 2 layers x (latent 32 + 32 rotary dims) x 4 bytes.
  assert mla["kv_bytes_per_token"] == bytes_per_token(big) * 8 / big.num_heads == 2 * (32 + 32) * 4
  assert (mla["kv_latent_rank"], mla["rope_dims"], mla["params"]) == (32, 32, "mla_r32_rope32_alpha0.1_distill1")
  # Oracle: decoding reads the latent cache absorbed, the prefill expanded; the two agree.
  assert mla["decode_bits_per_byte"] == pytest.approx(mla["bits_per_byte"], rel=1e-4)
  # The same uptraining as the heads family's best rows: alpha and distillation.
  gqa_run = json.loads((workdir / "kv2_pca_alpha0.1_distill1" / "uptrain.json").read_text())
  mla_run = json.loads((workdir / mla["params"] / "uptrain.json").read_text())
  assert mla_run["conversion"] == {"kv_latent_rank": 32, "rope_dims": 32, "factorisation": "activation"}
  assert {k: mla_run[k] for k in ("fraction", "distill", "steps", "source_step")} == {
    k: gqa_run[k] for k in ("fraction", "distill", "steps", "source_step")
  }


def test_kvjax_eval_recall_scores_as_the_study_does(frontier, capsys):
  study, workdir, rows = frontier
  rc = study.recall
  capsys.readouterr()
  assert (
    kvjax_main(
      [
        "eval",
        "--workdir",
        str(workdir / "mha_big"),
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
  assert kvjax_main(["eval", "--workdir", str(workdir / "mha_big"), "--recall", "4"]) == 2
  assert "below 24" in capsys.readouterr().err
  assert kvjax_main(["eval", "--workdir", str(workdir / "mha_big"), "--recall", "24", "--batches", "2"]) == 2
  assert "--batches" in capsys.readouterr().err


def test_a_finished_study_is_reused_read_only(frontier, tmp_path):
  study, source, rows = frontier
  before = tree_state(source)
  reuse = dataclasses.replace(study, gqa_workdir=str(source), variants=study.variants[:1] + study.variants[-1:])
  with claim_study(tmp_path, reuse):
    again = driver()(reuse, tmp_path)
  assert tree_state(source) == before and not (tmp_path / "mha_big").exists()
  for row, want in zip(again, [rows[0], rows[-1]]):
    assert row["variant"] == want["variant"] and row["bits_per_byte"] == want["bits_per_byte"]
  other = dataclasses.replace(reuse, gqa=dataclasses.replace(study.gqa, fraction=0.2))
  with pytest.raises(ValueError, match=r"other settings.*fraction: 0.1 -> 0.2"):
    kvf.prepare_sources(other, tmp_path)
  missing = dataclasses.replace(reuse, variants=(kvf.Variant("GQA-4", "heads", conversion=KVHeads(4)),))
  with pytest.raises(ValueError, match=r"has not finished \['kv4_mean_alpha0.1'\]"):
    kvf.prepare_sources(missing, tmp_path)


def test_a_variant_this_kvjax_lacks_is_refused_up_front(tmp_path):
  study = load_config(TINY)
  too_wide = dataclasses.replace(
    study, variants=study.variants[:1] + (kvf.Variant("ring", "window", CacheConfig(window=(4096,))),)
  )
  with pytest.raises(
    ValueError,
    match=r"variant 'ring' \(window=\(4096,\)\) cannot decode its model: .*window\[0\]=4096 "
    "is larger than max_len=128",
  ):
    kvf.check_variants(too_wide)
  odd = dataclasses.replace(study.gqa.big, head_dim=9, positions="learned")
  with pytest.raises(ValueError, match=r"variant 'int4' \(dtype=int4\) cannot decode its model: an int4 cache packs"):
    kvf.check_cache(odd, kvf.Variant("int4", "dtype", CacheConfig(dtype="int4")))
  bad = dataclasses.replace(study, variants=(kvf.Variant("ring", "window", CacheConfig(window=(4096,))),))
  with pytest.raises(ValueError, match=r"variant 'ring'.*cannot decode its model"):
    with claim_study(tmp_path, bad):
      driver()(bad, tmp_path)
  assert not (tmp_path / "mha_big").exists()  # refused before anything trained


def test_bad_study_configs_name_the_field():
  study = load_config(TINY)
  with pytest.raises(ValueError, match="names must be distinct"):
    dataclasses.replace(study, variants=study.variants[:1] * 2)
  with pytest.raises(
    ValueError,
    match=r"Variant 'GQA-3': kv3_mean does not convert MHA-big: KVHeads.num_kv_heads=3: "
    "cannot convert 16 kv heads to 3",
  ):
    dataclasses.replace(study, variants=(kvf.Variant("GQA-3", "heads", conversion=KVHeads(3)),))
  with pytest.raises(ValueError, match=r"Variant 'x': cache must be a CacheConfig, got \{'num_kv_heads': 2\}"):
    kvf.Variant("x", "window", {"num_kv_heads": 2})
  with pytest.raises(ValueError, match="Variant.family must be one of"):
    kvf.Variant("x", "pruning")
  with pytest.raises(
    ValueError, match="family 'mla' runs params converted by a conversion of that kind, got conversion=None"
  ):
    kvf.Variant("x", "mla")
  with pytest.raises(ValueError, match="family 'heads' .* got conversion=mla_r32_rope32"):
    kvf.Variant("x", "heads", conversion=ToMLA(32, 32))
  with pytest.raises(ValueError, match="distill=1.0 needs a conversion to uptrain"):
    kvf.Variant("x", "window", CacheConfig(window=(16,)), distill=1.0)
  with pytest.raises(ValueError, match="rope_dims=8 must be a multiple of 2 x num_kv_heads=32"):
    dataclasses.replace(study, variants=(kvf.Variant("x", "mla", conversion=ToMLA(8, 8)),))
  with pytest.raises(ValueError, match="rope_dims=32 leaves no latent at the bytes of 2 kv heads"):
    ToMLA.at_kv_heads(study.gqa.big, 2, 32)
  # A cache change on converted params is a point of its own family.
  windowed = kvf.Variant("GQA-2 window 16", "window", CacheConfig(window=(16,)), conversion=KVHeads(2))
  assert kvf.source(dataclasses.replace(study, variants=(windowed,)), windowed) == "kv2_mean_alpha0.1"
  with pytest.raises(ValueError, match="context=4096 exceeds MHA-big's max_len=128"):
    dataclasses.replace(study, context=4096)
  with pytest.raises(ValueError, match="distance 200 needs"):
    dataclasses.replace(study, recall=dataclasses.replace(study.recall, distances=(200,)))
  cpu = load_config(ROOT / "configs/kv_frontier/cpu.py")
  assert cpu.context == 2048 and {v.family for v in cpu.variants} == set(kvf.FAMILIES)
