"""The tiny GQA table end to end (the session fixture gqa_tiny, tests/conftest.py), the three
figures run in a copy of its workdir (reusing its models), and `kvjax uptrain` on its MHA-big
checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from kvjax.training import checkpoint
from kvjax.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def tree_state(path: Path) -> dict:
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.mark.tier2
def test_tiny_table_writes_every_file_with_the_paper_rows(gqa_tiny):
  for suffix in ("md", "csv", "json", "png"):
    assert (gqa_tiny / f"gqa_table.{suffix}").stat().st_size > 0
  rows = json.loads((gqa_tiny / "gqa_table.json").read_text())
  assert [(r["model"], r["num_kv_heads"]) for r in rows] == [
    ("MHA-small", 4),
    ("MHA-big", 16),
    ("GQA-2-big", 2),
    ("MQA-big", 1),
    ("GQA-2-big (pca + distill)", 2),
    ("MQA-big (pca + distill)", 1),
    ("MLA-big (32+32 + distill)", 8),
  ]
  small, big = rows[0], rows[1]
  for row in rows[2:]:
    assert row["kv_bytes_per_token"] * 16 == big["kv_bytes_per_token"] * row["num_kv_heads"]
    assert row["converted_bits_per_byte"] > 0 and row["params"] < big["params"]
  for row in rows:
    assert row["time_per_sample_s"] > 0 and 0 < row["bits_per_byte"] < 8 and len(row["times_s"]) == 5
    # The paper's protocol: a score per task, their mean, and the gap closed on both metrics.
    assert all(0 <= row[task] <= 100 for task in ("prose", "rot13", "recall"))
    assert row["avg_score"] == pytest.approx((row["prose"] + row["rot13"] + row["recall"]) / 3)
    want = (small["bits_per_byte"] - row["bits_per_byte"]) / (small["bits_per_byte"] - big["bits_per_byte"])
    assert row["gap_closed_bits"] == pytest.approx(want)
  assert rows[4]["time_per_sample_s"] == rows[2]["time_per_sample_s"]  # same architecture, same timing
  assert rows[6]["time_per_sample_s"] not in {r["time_per_sample_s"] for r in rows[:6]}  # MLA: timed itself
  mla = json.loads((gqa_tiny / "mla_r32_rope32_alpha0.1_distill1" / "uptrain.json").read_text())
  pca = json.loads((gqa_tiny / "kv2_pca_alpha0.1_distill1" / "uptrain.json").read_text())
  assert mla["conversion"] == {"kv_latent_rank": 32, "rope_dims": 32, "factorisation": "activation"}
  assert pca["conversion"] == {"num_kv_heads": 2, "method": "pca", "seed": 0}
  assert {k: mla[k] for k in ("fraction", "distill", "steps")} == {k: pca[k] for k in ("fraction", "distill", "steps")}
  text = (gqa_tiny / "gqa_table.md").read_text()
  assert "GQA-8-XXL" in text and "| GQA-2-big | 2 |" in text
  assert "fine-tuned for 3 steps" in text and "gap closed" in text


@pytest.mark.tier2
def test_rerun_skips_finished_stages(gqa_tiny, capsys):
  before = tree_state(gqa_tiny / "mha_big")
  assert main(["run", str(ROOT / "configs/gqa_table/tiny.py"), "--workdir", str(gqa_tiny)]) == 0
  out, err = capsys.readouterr()
  assert out == (gqa_tiny / "gqa_table.md").read_text()  # stdout: the table alone
  assert "stage pretrain_big: done earlier (in stages.json)" in err and ": running" not in err
  assert tree_state(gqa_tiny / "mha_big") == before


def test_stages_recorded_before_new_fields_still_read(tmp_path):
  """A stages.json written before ModelConfig.window / sink_tokens and GqaStudy.conversions existed
  (runs/gqa_cpu's, which records best_method) is the same study: those fields take their defaults,
  best_method is retired, conversions selects stages."""
  from kvjax.cli.run import load_config
  from kvjax.fields import to_dict
  from kvjax.studies.parts import gqa as gs
  from kvjax.training.workdir import claim_study

  study = load_config(ROOT / "configs/gqa_table/cpu.py")
  assert len(study.conversions) == 4
  old = {k: v for k, v in to_dict(study).items() if k not in ("job", "fractions", "methods", "conversions")}
  old["best_method"] = "pca"
  for name in ("small", "big"):
    old[name] = {k: v for k, v in old[name].items() if k not in ("window", "sink_tokens")}
  with claim_study(tmp_path, study):
    (tmp_path / "stages.json").write_text(json.dumps({"study": old, "pretrain_big": {}}))
    assert "pretrain_big" in gs.open_stages(study, tmp_path).done
    with pytest.raises(ValueError, match="fraction: 0.05 -> 0.2"):
      gs.open_stages(dataclasses.replace(study, fraction=0.2), tmp_path)


@pytest.mark.tier2
def test_rerun_with_other_settings_is_refused(gqa_tiny, capsys):
  before = (gqa_tiny / "stages.json").read_text()
  assert (
    main(["run", str(ROOT / "configs/gqa_table/tiny.py"), "--workdir", str(gqa_tiny), "--set", "timing.batch=4"]) == 2
  )
  assert "timing.batch: 8 -> 4" in capsys.readouterr().err
  assert (gqa_tiny / "stages.json").read_text() == before


@pytest.mark.tier2
def test_uptrain_cli_records_quality_and_leaves_the_source_alone(gqa_tiny, tmp_path, capsys):
  source = gqa_tiny / "mha_big"
  before = tree_state(source)
  dest = tmp_path / "gqa4"
  assert main(["uptrain", "--from", str(source), "--workdir", str(dest), "--kv-heads", "4", "--fraction", "0.1"]) == 0
  record = json.loads((dest / "uptrain.json").read_text())
  assert record["source_step"] == 60 and record["steps"] == 6
  assert record["conversion"] == {"num_kv_heads": 4, "method": "mean", "seed": 0}
  assert set(record) >= {"before", "converted", "after"}
  assert "uptrained (alpha=0.1)" in capsys.readouterr().out
  model, params, _ = checkpoint.load_model(dest)
  assert model.config.num_kv_heads == 4 and checkpoint.latest_step(dest) == 6
  assert params["layers_0"]["attn"]["k"]["kernel"].shape[1] == 4
  assert tree_state(source) == before


@pytest.mark.tier2
def test_uptrain_errors_name_the_problem(gqa_tiny, tmp_path, capsys):
  source = gqa_tiny / "mha_big"
  assert main(["uptrain", "--from", str(source), "--workdir", str(tmp_path / "x"), "--kv-heads", "3"]) == 2
  assert "kvjax uptrain: error: KVHeads.num_kv_heads=3: cannot convert 16 kv heads to 3" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(source), "--workdir", str(source / "inside"), "--kv-heads", "4"]) == 2
  assert "never modified" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(tmp_path / "empty"), "--workdir", str(tmp_path / "y"), "--kv-heads", "4"]) == 2
  assert "no checkpoint" in capsys.readouterr().err


def run_figure(gqa_tiny: Path, tmp_path: Path, job: str, capsys, *overrides: str) -> tuple[Path, list[dict], str, set]:
  """`kvjax run configs/<job>/tiny.py` in a copy of the table's workdir: (the copy, its rows, its
  stderr, the model folders it added)."""
  workdir = tmp_path / "workdir"
  shutil.copytree(gqa_tiny, workdir)
  before = {p.name for p in workdir.iterdir() if p.is_dir()}
  argv = ["run", str(ROOT / "configs" / job / "tiny.py"), "--workdir", str(workdir)]
  assert main(argv + (["--set", *overrides] if overrides else [])) == 0
  out, err = capsys.readouterr()
  assert out == (workdir / f"{job}.md").read_text()  # stdout: the figure's table alone
  assert (workdir / f"{job}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  rows = json.loads((workdir / f"{job}.json").read_text())
  return workdir, rows, err, {p.name for p in workdir.iterdir() if p.is_dir()} - before


def uptraining(workdir: Path, name: str) -> dict:
  return json.loads((workdir / name / "uptrain.json").read_text())


@pytest.mark.tier2
def test_figure4_reuses_the_tables_uptrainings_and_adds_each_method(gqa_tiny, tmp_path, capsys):
  workdir, rows, err, added = run_figure(gqa_tiny, tmp_path, "gqa_figure4", capsys, "methods=('mean', 'first')")
  assert [(r["model"], r["num_kv_heads"], r["method"]) for r in rows] == [
    ("MQA-big", 1, "mean"),
    ("MQA-big", 1, "first"),
    ("GQA-2-big", 2, "mean"),
    ("GQA-2-big", 2, "first"),
  ]
  assert added == {"kv1_first_alpha0.1", "kv2_first_alpha0.1"}
  assert "stage kv1_mean_alpha0.1: done earlier" in err and "stage kv1_first_alpha0.1: running" in err
  for row in rows:
    record = uptraining(workdir, f"kv{row['num_kv_heads']}_{row['method']}_alpha0.1")
    assert row["bits_per_byte"] == record["after"]["bits_per_byte"]
    assert row["converted_bits_per_byte"] == record["converted"]["bits_per_byte"]
  # Two ways of building the heads, two converted models: their quality differs.
  assert rows[0]["converted_bits_per_byte"] != rows[1]["converted_bits_per_byte"]


@pytest.mark.tier2
def test_figure5_at_alpha_zero_is_the_conversion_alone(gqa_tiny, tmp_path, capsys):
  workdir, rows, err, added = run_figure(gqa_tiny, tmp_path, "gqa_figure5", capsys, "fractions=(0.0, 0.1)")
  names = ["GQA-2-big", "MQA-big", "GQA-2-big (pca + distill)", "MQA-big (pca + distill)", "MLA-big (32+32 + distill)"]
  assert [(r["model"], r["alpha"]) for r in rows] == [(n, a) for n in ["MHA-big", *names] for a in (0.0, 0.1)]
  folders = ["kv2_mean", "kv1_mean", "kv2_pca", "kv1_pca", "mla_r32_rope32"]
  assert added == {f"{folder}_alpha0" for folder in folders}  # alpha = 0.1: the table's
  mha = json.loads((workdir / "stages.json").read_text())["pretrain_big"]
  assert [r["bits_per_byte"] for r in rows[:2]] == [mha["bits_per_byte"]] * 2
  for i, folder in enumerate(folders):
    at_zero, at_tenth = rows[2 + 2 * i], rows[3 + 2 * i]
    table = uptraining(workdir, f"{folder}_alpha0.1" + ("_distill1" if "pca" in folder or "mla" in folder else ""))
    # Uptrained for no steps, a model is its conversion: the table's quality right after converting.
    assert at_zero["bits_per_byte"] == pytest.approx(table["converted"]["bits_per_byte"], rel=1e-5)
    assert at_tenth["bits_per_byte"] == table["after"]["bits_per_byte"]
  assert "stage kv2_mean_alpha0: running" in err


@pytest.mark.tier2
def test_figure6_times_every_kv_head_count_of_mha_big(gqa_tiny, tmp_path, capsys):
  workdir, rows, err, added = run_figure(gqa_tiny, tmp_path, "gqa_figure6", capsys)
  assert added == set()  # timing needs no uptraining
  # MHA-big: 2 layers, keys and values of 4 float32 dims per kv head: 64 bytes per kv head.
  assert [(r["num_kv_heads"], r["kv_bytes_per_token"]) for r in rows] == [(k, 64 * k) for k in (1, 2, 4, 8, 16)]
  assert all(r["time_per_sample_s"] > 0 for r in rows)
  assert "stage pretrain_big: done earlier" in err and "stage timing_kv_sweep: running" in err
