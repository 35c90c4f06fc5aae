"""MLA configs: clear errors for impossible shapes, the payload its cache stores, and the
parameter count the memory budgets use, against the shapes of the module docstring by hand."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.model.attention import Field, kv_payload
from kvjax.model.mla import latent_payload
from kvjax.model.params import abstract_params, param_count
from kvjax.model.transformer import cache_payload
from conftest import tiny_config


@pytest.mark.parametrize(
  "changes, match",
  [
    (dict(kv_latent_rank=33, rope_dims=8), "kv_latent_rank=33 is larger than possible"),
    (dict(kv_latent_rank=8, rope_dims=20), "more than head_dim=8"),
    (dict(kv_latent_rank=8, rope_dims=6), "rope_dims=6 must split"),
    (dict(kv_latent_rank=8, rope_dims=4, positions="learned"), "positions='learned'"),
    (dict(kv_latent_rank=8), "rope_dims must be positive"),
    (dict(rope_dims=4), "need an MLA model"),
    (dict(kv_latent_rank=-1), "kv_latent_rank must be a non-negative"),
    (dict(kv_latent_rank=8, rope_dims=4, rope_pairs=((0,), (1,))), "rope_pairs must hold"),
    (dict(kv_latent_rank=8, rope_dims=4, rope_pairs=((0, 4), (1, 2))), "frequency index 4"),
  ],
)
def test_config_errors(changes, match):
  with pytest.raises(ValueError, match=match):
    tiny_config(2, **changes)


def test_windowed_mla_is_a_model():
  """Sliding windows and sinks are the network's (its masks), whatever its attention stores:
  an MLA model takes them (its caches: tests/cache/test_compose.py)."""
  config = tiny_config(2, kv_latent_rank=8, rope_dims=4, window=(16, 0), sink_tokens=2)
  assert (config.layer_window(0), config.layer_window(1), config.is_latent) == (16, 0, True)


def test_payload_is_what_the_attention_declares():
  """An MLA layer caches one latent [R] and one rotary key [rope_dims] per token, one "head"
  whatever num_heads; without RoPE only the latent. K/V layers cache k (read transposed) and v."""
  mla = tiny_config(2, kv_latent_rank=12, rope_dims=8)
  assert cache_payload(mla) == latent_payload(mla) == {"latent": Field(1, 12), "rope_key": Field(1, 8)}
  learned = tiny_config(2, kv_latent_rank=12, positions="learned")
  assert cache_payload(learned) == {"latent": Field(1, 12)}
  gqa = tiny_config(2)
  assert cache_payload(gqa) == kv_payload(gqa) == {"k": Field(2, 8, transposed=True), "v": Field(2, 8)}


def mla_params_by_hand(config: kvjax.ModelConfig) -> int:
  """The parameters of kvjax.model.mla's docstring, q [D, N, H], kv_down [D, R], k_rope [D, K*W],
  k_up [R, N, E], v_up [R, N, H], out [N, H, D] (biases with qkv_bias / use_bias), plus the
  embeddings, norms and MLPs of the layer loop."""
  d, n, h, f = config.d_model, config.num_heads, config.head_dim, config.mlp_dim
  r, w, e = config.kv_latent_rank, config.rope_dims, config.head_dim - config.rope_group_dims
  attn = d * n * h + d * r + d * w + r * n * e + r * n * h + n * h * d
  if config.qkv_bias:
    attn += n * h + r + w
  if config.use_bias:
    attn += d
  norm = d if config.norm == "rmsnorm" else 2 * d
  projections = 3 if config.activation == "swiglu" else 2
  mlp = projections * d * f + ((projections - 1) * f + d if config.use_bias else 0)
  total = config.vocab_size * d + config.num_layers * (2 * norm + attn + mlp) + norm
  if config.positions == "learned":
    total += config.max_len * d
  if not config.tie_embeddings:
    total += d * config.vocab_size
  return total


@pytest.mark.parametrize(
  "changes",
  [
    dict(),
    dict(qkv_bias=True, use_bias=True, num_kv_heads=1, rope_dims=4),
    dict(positions="learned", rope_dims=0, norm="layernorm", activation="gelu"),
  ],
)
def test_param_count(changes):
  changes = {"num_kv_heads": 2, "kv_latent_rank": 12, "rope_dims": 8, **changes}
  config = tiny_config(changes.pop("num_kv_heads"), **changes)
  assert param_count(config) == mla_params_by_hand(config)


def test_round_trip_and_overrides():
  config = tiny_config(2, kv_latent_rank=12, rope_dims=8, rope_pairs=((0, 1, 2, 3), (3, 2, 1, 0)))
  assert kvjax.from_dict(kvjax.ModelConfig, kvjax.to_dict(config)) == config
  assert kvjax.apply_overrides(config, ["kv_latent_rank=10"]).kv_latent_rank == 10


def test_run_configs_record_every_field_and_read_back():
  """A run's config dict records every ModelConfig field, the MLA ones at their defaults too
  (kvjax reads only workdirs that record its version), and reads back to the same config, GQA
  and MLA alike; a resume check finds no difference."""
  import dataclasses
  from kvjax.training import checkpoint
  from kvjax.training.config import TrainRun

  for model in (
    tiny_config(2, vocab_size=256, max_len=128),
    tiny_config(2, vocab_size=256, max_len=128, kv_latent_rank=8, rope_dims=4),
  ):
    recorded = kvjax.to_dict(TrainRun(model=model))
    assert set(recorded["model"]) == {f.name for f in dataclasses.fields(kvjax.ModelConfig)}
    assert recorded["model"]["kv_latent_rank"] == model.kv_latent_rank and recorded["model"]["rope_pairs"] is None
    assert kvjax.from_dict(TrainRun, recorded).model == model
    assert checkpoint.config_diffs(recorded, kvjax.to_dict(TrainRun(model=model))) == []


def test_hf_export_refuses_mla():
  from kvjax.interop.hf_export import plan_export

  config = tiny_config(2, kv_latent_rank=8, rope_dims=4)
  with pytest.raises(ValueError, match="no Hugging Face family") as refused:
    plan_export(config, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config)))
  assert str(refused.value).count("kv_latent_rank=8 (its models have 0)") == 3  # llama, qwen2 and gpt2
