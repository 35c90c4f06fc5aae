"""`kvjax bench real_long`: the cells it plans and refuses, one short request through each side (as a
cell's process runs it, here in the test's process), and the figures it derives from them."""

import json

import numpy as np
import pytest

from kvjax.bench.real_long import compare, plan
from kvjax.bench.parts.real_long_side import Cell, run_spec
from kvjax.cache.base import size_bucket
from kvjax.interop.importer import read_config

SOURCE = "smollm2-135m"


def test_plan_orders_cells_and_refuses_by_name():
  cells = plan(SOURCE, prompts=(64,), batches=(1, 2), new_tokens=4, codecs=("int8",), hf_caches=("static",))
  assert [(c.batch, c.side, c.cache) for c in cells] == [(1, "hf", "static"), (1, "kvjax", "int8")] + [
    (2, "hf", "static"),
    (2, "kvjax", "int8"),
  ]
  longest = read_config(SOURCE).max_positions - 256 + 1  # 7,937 for SmolLM2's 8,192 positions
  assert len(plan(SOURCE, prompts=(longest,), batches=(1,))) == 4
  with pytest.raises(ValueError, match=f"longest prompt with 256 new tokens is {longest}"):
    plan(SOURCE, prompts=(longest + 1,), batches=(1,))
  with pytest.raises(ValueError, match="hf_caches must name some of"):
    plan(SOURCE, prompts=(64,), batches=(1,), hf_caches=("sliding",))


def test_ratios_by_hand():
  shape = {"batch": 1, "prompt": 8, "new_tokens": 2, "weights": "float32"}
  rows = [
    {"side": "hf", **shape, "prefill_s": 4.0, "decode_s": 2.0, "request_s": 6.0},
    {"side": "hf", **shape, "prefill_s": 3.0, "decode_s": 4.0, "request_s": 7.0},
    {"side": "hf", **shape, "weights": "int8", "prefill_s": 0.1, "decode_s": 0.1, "request_s": 0.2},
    {"side": "kvjax", **shape, "prefill_s": 1.0, "decode_s": 1.0, "request_s": 2.0},
  ]
  compare(rows)
  # Each phase against transformers' best cache in that phase, same weight format only.
  assert rows[3]["over_hf_best"] == {"prefill": 3.0, "decode": 2.0, "request": 3.0}
  assert "over_hf_best" not in rows[0]


@pytest.mark.tier2
def test_both_sides_run_one_request_and_agree(tmp_path):
  batch, prompt, new = 2, 24, 5
  rng = np.random.default_rng(0)
  prompts = rng.integers(10, 4000, size=(batch, prompt)).astype(np.int32)
  np.save(tmp_path / "prompts.npy", prompts)
  results, ids = {}, {}
  for side, cache in (("kvjax", "float32"), ("hf", "static"), ("hf", "dynamic")):
    cell = Cell(side=side, cache=cache, weights="float32", batch=batch, prompt=prompt, new_tokens=new)
    spec = {"source": SOURCE, "cell": vars(cell), "prompts": str(tmp_path / "prompts.npy")}
    spec["ids"] = str(tmp_path / f"{cell.name}.npy")
    results[side, cache] = json.loads(json.dumps(run_spec(spec)))
    ids[side, cache] = np.load(spec["ids"])
  assert ids["kvjax", "float32"].shape == (batch, new)
  np.testing.assert_array_equal(ids["kvjax", "float32"], ids["hf", "static"])
  np.testing.assert_array_equal(ids["hf", "dynamic"], ids["hf", "static"])
  config = read_config(SOURCE)
  per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # float32 k and v
  # kvjax stores a bucket of positions (prompt + new - 1 rounded up, kvjax.cache.base.size_bucket);
  # transformers' static cache prompt + new, its dynamic one the positions fed (the last token is never fed).
  bucket = size_bucket(prompt + new - 1, config.max_len)
  assert bucket < 32 and results["kvjax", "float32"]["kv_bytes"] == batch * bucket * per_position
  assert results["hf", "static"]["kv_bytes"] == batch * (prompt + new) * per_position
  assert results["hf", "dynamic"]["kv_bytes"] == batch * (prompt + new - 1) * per_position
  row = results["kvjax", "float32"]
  assert row["request_s"] == pytest.approx(row["prefill_s"] + row["decode_s"])
  assert row["decode_tokens_per_s"] == pytest.approx(batch * (new - 1) / row["decode_s"])
  assert row["name"] == "kvjax_float32_float32_2x24+5" and row["peak_gib"] >= row["request_peak_gib"] > 0
