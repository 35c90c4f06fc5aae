"""`kvjax bench mla` at toy size compares what it claims to (speed is not tested)."""

from __future__ import annotations

from kvjax.bench import mla


def test_bench_mla_compares_equal_bytes_and_equal_latents(bench_model):
  """The MLA model caches as many bytes per token as the GQA one, and its absorbed and expanded
  reads of the same latents give the same first step."""
  result = mla.bench_mla(bench_model, batch=2, repeats=2, context=32, rope_dims=8)
  assert result["kv_bytes_per_token"]["mla"] == result["kv_bytes_per_token"]["gqa"]
  assert result["mla_model"]["kv_latent_rank"] == 24 and result["first_step_max_logit_diff"] < 1e-4
  assert result["mla_over_gqa"] > 0
