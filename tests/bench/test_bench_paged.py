"""`kvjax bench paged` at toy size compares what it claims to (speed is not tested)."""

from __future__ import annotations

import pytest

from kvjax.bench.serving import paged


def test_bench_paged_compares_equal_caches(bench_model):
  """The paged and contiguous caches hold the same K/V, so their first steps agree."""
  result = paged.bench_paged(bench_model, batch=2, repeats=2, context=64, page_size=8)
  assert result["first_step_max_logit_diff"] < 1e-5
  assert result["context"] == 64 and result["steps"] == 8 and result["paged_over_contiguous"] > 0


def test_bench_paged_refuses_a_context_off_the_pages(bench_model):
  with pytest.raises(ValueError, match="context=60 must be a multiple of page_size=8"):
    paged.bench_paged(bench_model, batch=2, repeats=2, context=60, page_size=8)
