"""The real-model studies end to end on the first 2 layers of SmolLM2-135M-Instruct: the GQA table
(configs/gqa_table/smollm2_tiny.py) makes every model, the frontier (configs/kv_frontier/
smollm2_tiny.py) reads them from its workdir; the rows are checked against oracles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cli.main import main
from kvjax.studies import real_kv
from kvjax.studies.real_frontier import RealFrontierStudy, Variant, pareto
from kvjax.studies.real_kv import Params, Recovery
from conftest import load_module

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("real")
  assert main(["run", str(CONFIGS / "gqa_table" / "smollm2_tiny.py"), "--workdir", str(root / "gqa")]) == 0
  frontier = ["run", str(CONFIGS / "kv_frontier" / "smollm2_tiny.py"), "--workdir", str(root / "frontier")]
  assert main([*frontier, "--set", f"models_from={str(root / 'gqa')!r}"]) == 0
  table = json.loads((root / "gqa" / "real_gqa_table.json").read_text())
  rows = json.loads((root / "frontier" / "real_frontier.json").read_text())
  return root, table, {r["variant"]: r for r in rows}


def test_the_gqa_table_rows_and_files(runs):
  root, table, _ = runs
  assert [r["model"] for r in table] == [
    "as shipped (GQA-3)",
    "MQA mean, alpha 0",
    "MQA mean + local recovery",
    "MQA pca + local recovery",
    "MLA 104+24 (MQA bytes) + local recovery",
  ]
  assert table[0]["gap_closed"] == 1.0 and table[1]["gap_closed"] == 0.0
  # 2 layers x (K + V) x kv heads x 64 dims x 4 bytes; MLA at MQA's bytes exactly.
  assert [r["kv_bytes_per_token"] for r in table] == [3072, 1024, 1024, 1024, 1024]
  for row in table:
    assert row["time_per_sample_s"] > 0 and math.isfinite(row["perplexity_128"])
  for name in ("real_gqa_table.md", "real_gqa_table.csv", "real_gqa_table.png"):
    assert (root / "gqa" / name).stat().st_size > 0
  assert "Gap closed" in (root / "gqa" / "real_gqa_table.md").read_text()
  for folder in ("kv1_mean_local", "kv1_pca_local", "mla_r104_rope24_local"):
    record = json.loads((root / "gqa" / folder / "uptrain.json").read_text())
    assert record["recovery"] == "local" and len(record["layers"]) == 2
    assert all(layer["loss_after"] <= layer["loss_before"] for layer in record["layers"])
  # A recovered row runs the recovered params: not the alpha = 0 ones.
  assert table[2]["perplexity_128"] != table[1]["perplexity_128"]


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


def test_the_frontier_rows_against_oracles(runs):
  root, table, rows = runs
  study = load_module(CONFIGS / "kv_frontier" / "smollm2_tiny.py").get_config()
  assert list(rows) == [v.name for v in study.variants]
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
  # 8 bytes of position and score each per kv head.
  assert rows["int8"]["kv_bytes_per_token"] == pytest.approx(2 * 2 * 3 * 68, abs=1)
  assert rows["window 32"]["kv_bytes_per_token"] == pytest.approx(3072 * 32 / 128, abs=1)
  assert rows["window 32 + 4 sinks"]["kv_bytes_per_token"] == pytest.approx(3072 * 36 / 128, abs=1)
  assert rows["snapkv 0.5"]["kv_bytes_per_token"] == pytest.approx((3072 + 2 * 3 * 8) * 64 / 128, abs=1)
  assert rows["int8 + snapkv 0.5"]["kv_bytes_per_token"] == pytest.approx((816 + 2 * 3 * 8) * 64 / 128, abs=1)
  # What a cache drops changes the numbers; the front is computed from them.
  assert rows["window 32"]["perplexity_128"] != rows["full cache"]["perplexity_128"]
  ordered = list(rows.values())
  assert [r["pareto_perplexity"] for r in ordered] == pareto(ordered, "kv_bytes_per_token", "perplexity_128")
  for name in ("real_frontier.md", "real_frontier.csv", "real_frontier_perplexity.png", "real_frontier_recall.png"):
    assert (root / "frontier" / name).stat().st_size > 0


def test_models_from_a_study_with_other_settings_is_refused(runs, tmp_path):
  root, _, _ = runs
  with pytest.raises(ValueError, match="other settings.*recovery.steps: 3 -> 4"):
    real_kv.prepare(
      "smollm2-135m",
      2,
      Recovery(steps=4, batch_size=2, seq_len=32, data_bytes=200_000, windows=32),
      [Params()],
      tmp_path,
      str(root / "gqa"),
    )
  with pytest.raises(ValueError, match="not a real-model study's workdir"):
    real_kv.prepare("smollm2-135m", 2, Recovery(), [Params()], tmp_path, str(tmp_path / "nothing"))


def test_bad_variants_are_refused():
  with pytest.raises(ValueError, match="family"):
    Variant("x", "quantum")
  with pytest.raises(ValueError, match="names must be distinct"):
    RealFrontierStudy(variants=(Variant("a", "full"), Variant("a", "codec", CacheConfig(dtype="int8"))))
  with pytest.raises(ValueError, match="needs a conversion"):
    Params(recovered=True)
  with pytest.raises(ValueError, match="Recovery.mode"):
    Recovery(mode="none")
