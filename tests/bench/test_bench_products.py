"""`kvjax bench products` at toy size reports what it claims to (speed is not tested)."""

from __future__ import annotations

import pytest

from kvjax.bench import products


def test_bench_products_counts_each_products_flops(bench_model):
  result = products.bench_products(bench_model, rows=8, batch=1, prompt=16, repeats=1)
  rows = {(r["format"], r["product"]): r for r in result["results"]}
  shapes = products.weight_shapes(bench_model)
  assert set(rows) == {(f, p) for f in products.FORMATS for p in [*shapes, "attention"]}
  for (fmt, name), row in rows.items():
    if name == "attention":  # causal: half of the T x T scores, QK and PV
      n, h = bench_model.num_heads, bench_model.head_dim
      assert row["gflop"] * 1e9 == pytest.approx(4 * n * 16 * 16 * h / 2)
    else:
      k, n = shapes[name]
      assert row["gflop"] * 1e9 == pytest.approx(2 * 8 * k * n)
    assert row["kvjax_GFLOPs"] > 0 and row["over_torch"] == pytest.approx(row["kvjax_GFLOPs"] / row["torch_GFLOPs"])
