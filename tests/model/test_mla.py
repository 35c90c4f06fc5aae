"""MLA configs: clear errors for impossible shapes, and the parameter count the memory budgets use."""

from __future__ import annotations

import math

import jax
import pytest

import kvjax
from kvjax import memory
from kvjax.model.params import abstract_params
from conftest import tiny_config


@pytest.mark.parametrize("changes, match", [
    (dict(kv_latent_rank=33, rope_dims=8), "kv_latent_rank=33 is larger than possible"),
    (dict(kv_latent_rank=8, rope_dims=20), "more than head_dim=8"),
    (dict(kv_latent_rank=8, rope_dims=6), "rope_dims=6 must split"),
    (dict(kv_latent_rank=8, rope_dims=4, positions="learned"), "positions='learned'"),
    (dict(kv_latent_rank=8), "rope_dims must be positive"),
    (dict(rope_dims=4), "need an MLA model"),
    (dict(kv_latent_rank=-1), "kv_latent_rank must be a non-negative"),
    (dict(kv_latent_rank=8, rope_dims=4, rope_pairs=((0,), (1,))), "rope_pairs must hold"),
    (dict(kv_latent_rank=8, rope_dims=4, rope_pairs=((0, 4), (1, 2))), "frequency index 4"),
    (dict(kv_latent_rank=8, rope_dims=4, window=(16, 0)), r"window=\(16, 0\) asks for sliding-window layers in an MLA"),
    (dict(kv_latent_rank=8, rope_dims=4, cache_dtype="int8"), "cache_dtype='int8' asks for a quantized cache of an MLA"),
])
def test_config_errors(changes, match):
  with pytest.raises(ValueError, match=match):
    tiny_config(2, **changes)


@pytest.mark.parametrize("changes", [dict(), dict(qkv_bias=True, use_bias=True, num_kv_heads=1, rope_dims=4),
                                     dict(positions="learned", rope_dims=0)])
def test_param_count(changes):
  changes = {"num_kv_heads": 2, "kv_latent_rank": 12, "rope_dims": 8, **changes}
  config = tiny_config(changes.pop("num_kv_heads"), **changes)
  leaves = jax.tree.leaves(abstract_params(config))
  assert memory.param_count(config) == sum(math.prod(x.shape) for x in leaves)


def test_round_trip_and_overrides():
  config = tiny_config(2, kv_latent_rank=12, rope_dims=8, rope_pairs=((0, 1, 2, 3), (3, 2, 1, 0)))
  assert kvjax.from_dict(kvjax.ModelConfig, kvjax.to_dict(config)) == config
  assert kvjax.apply_overrides(config, ["kv_latent_rank=10"]).kv_latent_rank == 10


def test_other_models_serialise_as_before():
  """The MLA fields are written only when set: a GQA model's config dict (and so the saved configs
  of runs recorded before MLA, their resume checks and fingerprints) is unchanged."""
  from kvjax.training import checkpoint
  from kvjax.training.config import TrainRun
  gqa = kvjax.to_dict(TrainRun(model=tiny_config(2, vocab_size=256, max_len=128)))
  assert not {"kv_latent_rank", "rope_dims", "rope_pairs"} & set(gqa["model"])
  assert kvjax.from_dict(TrainRun, gqa).model == tiny_config(2, vocab_size=256, max_len=128)
  assert checkpoint.config_diffs(gqa, kvjax.to_dict(TrainRun(model=tiny_config(2, vocab_size=256, max_len=128)))) == []
  mla = kvjax.to_dict(TrainRun(model=tiny_config(2, vocab_size=256, max_len=128, kv_latent_rank=8, rope_dims=4)))
  assert mla["model"]["kv_latent_rank"] == 8 and "rope_pairs" not in mla["model"]


def test_hf_export_refuses_mla():
  from kvjax.interop.hf_export import family
  with pytest.raises(ValueError, match="kv_latent_rank=8 has no Hugging Face Llama / Qwen2 equivalent"):
    family(tiny_config(2, kv_latent_rank=8, rope_dims=4))
