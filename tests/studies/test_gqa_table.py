"""The tiny GQA table end to end, and `kvjax uptrain` on its MHA-big checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvjax.training import checkpoint
from kvjax.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def tree_state(path: Path) -> dict:
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("gqa_tiny")
  assert main(["run", str(ROOT / "configs/gqa_table/tiny.py"), "--workdir", str(workdir)]) == 0
  return workdir


def test_tiny_table_writes_every_file_with_the_paper_rows(table):
  for suffix in ("md", "csv", "json", "png"):
    assert (table / f"gqa_table.{suffix}").stat().st_size > 0
  rows = json.loads((table / "gqa_table.json").read_text())
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
  mla = json.loads((table / "mla_r32_rope32_alpha0.1_distill1" / "uptrain.json").read_text())
  pca = json.loads((table / "kv2_pca_alpha0.1_distill1" / "uptrain.json").read_text())
  assert mla["conversion"] == {"kv_latent_rank": 32, "rope_dims": 32, "factorisation": "activation"}
  assert pca["conversion"] == {"num_kv_heads": 2, "method": "pca", "seed": 0}
  assert {k: mla[k] for k in ("fraction", "distill", "steps")} == {k: pca[k] for k in ("fraction", "distill", "steps")}
  text = (table / "gqa_table.md").read_text()
  assert "GQA-8-XXL" in text and "| GQA-2-big | 2 |" in text
  assert "fine-tuned for 3 steps" in text and "gap closed" in text


def test_rerun_skips_finished_stages(table, capsys):
  before = tree_state(table / "mha_big")
  assert main(["run", str(ROOT / "configs/gqa_table/tiny.py"), "--workdir", str(table)]) == 0
  out, err = capsys.readouterr()
  assert out == (table / "gqa_table.md").read_text()  # stdout: the table alone
  assert "stage pretrain_big: done earlier (in stages.json)" in err and ": running" not in err
  assert tree_state(table / "mha_big") == before


def test_stages_recorded_before_new_fields_still_read(tmp_path):
  """A stages.json written before ModelConfig.window / sink_tokens and GqaStudy.conversions existed
  (runs/gqa_cpu's, which records best_method) is the same study: those fields take their defaults,
  best_method is retired, conversions selects stages."""
  from kvjax.cli.run import load_config
  from kvjax.fields import to_dict
  from kvjax.studies import gqa as gs
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


def test_rerun_with_other_settings_is_refused(table, capsys):
  before = (table / "stages.json").read_text()
  assert main(["run", str(ROOT / "configs/gqa_table/tiny.py"), "--workdir", str(table), "--set", "timing.batch=4"]) == 2
  assert "timing.batch: 8 -> 4" in capsys.readouterr().err
  assert (table / "stages.json").read_text() == before


def test_uptrain_cli_records_quality_and_leaves_the_source_alone(table, tmp_path, capsys):
  source = table / "mha_big"
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


def test_uptrain_errors_name_the_problem(table, tmp_path, capsys):
  source = table / "mha_big"
  assert main(["uptrain", "--from", str(source), "--workdir", str(tmp_path / "x"), "--kv-heads", "3"]) == 2
  assert "kvjax uptrain: error: KVHeads.num_kv_heads=3: cannot convert 16 kv heads to 3" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(source), "--workdir", str(source / "inside"), "--kv-heads", "4"]) == 2
  assert "never modified" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(tmp_path / "empty"), "--workdir", str(tmp_path / "y"), "--kv-heads", "4"]) == 2
  assert "no checkpoint" in capsys.readouterr().err
