"""Sharded == single-device, on 8 host CPU devices. Run by tests/test_sharding.py in a child
process with XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be set before
JAX starts and so cannot share a process with the other tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from kvjax import ModelConfig, Transformer, sharding
from kvjax.cache.config import CacheConfig
from kvjax.training import checkpoint
from kvjax.cli import main as cli
from kvjax.decoding import decode
from kvjax.model.params import abstract_params
from kvjax.training import train
from kvjax.training.step import TrainState, make_train_step

# 8 kv heads: one per device on model=8. The second has 2 kv heads, fewer than model=4
# devices, so its k/v and cache are replicated; it also has every bias and tied embeddings.
KV8 = ModelConfig(
  vocab_size=64, d_model=64, num_layers=1, num_heads=16, num_kv_heads=8, head_dim=8, mlp_dim=128, max_len=48
)
KV2 = ModelConfig(
  vocab_size=64,
  d_model=32,
  num_layers=1,
  num_heads=8,
  num_kv_heads=2,
  activation="gelu",
  norm="layernorm",
  positions="learned",
  qkv_bias=True,
  use_bias=True,
  tie_embeddings=True,
  max_len=48,
)
# MLA: per token one latent [16] and one rotary key [8] shared by the 16 query heads: its cache's
# one "head" does not split over `model` (the query heads and their up-projections do).
MLA = ModelConfig(
  vocab_size=64,
  d_model=64,
  num_layers=1,
  num_heads=16,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=128,
  max_len=48,
  kv_latent_rank=16,
  rope_dims=8,
)


NEW_TOKENS = 8


def setup_module():
  assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def init(config: ModelConfig, seed: int = 0):
  """Random params drawn on the host in the shapes of Transformer.init: no init compile."""
  model = Transformer(config)
  shapes = abstract_params(config)
  rng = np.random.default_rng(seed)

  def draw(path, x):
    name = str(path[-1].key)
    if name == "scale":
      return (1 + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
    if name == "bias":
      return (0.1 * rng.standard_normal(x.shape)).astype(np.float32)
    fan_in = 1 if name != "kernel" else x.shape[0] * (x.shape[1] if str(path[-2].key) == "out" else 1)
    if name in ("k_up", "v_up"):  # MLA's up-projections [R, N, ...] from the latent
      fan_in = x.shape[0]
    return (rng.standard_normal(x.shape) / np.sqrt(fan_in)).astype(np.float32)

  return model, jax.tree_util.tree_map_with_path(draw, shapes)


def prompts(batch: int, seq: int, vocab: int):
  rng = np.random.default_rng(0)
  lengths = rng.integers(2, seq + 1, batch).astype(np.int32)
  tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
  return tokens, lengths


def spec(x) -> tuple:
  return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


def layout(x) -> tuple | None:
  """spec(x) of an array placed on a mesh; None for one on a single device or in host memory."""
  return spec(x) if isinstance(getattr(x, "sharding", None), NamedSharding) else None


@pytest.mark.parametrize(
  "config, data, model_axis, kv_spec",
  [
    (KV8, 1, 8, (None, "model", None, None)),
    (KV2, 2, 4, ("data", None, None, None)),
  ],
)
def test_prefill_decode_generate_match_one_device(config, data, model_axis, kv_spec):
  mesh = sharding.make_mesh(data=data, model=model_axis)
  model, params = init(config)
  tokens, lengths = prompts(4, 9, config.vocab_size)
  ref_logits, ref_cache = decode.prefill(model, params, tokens, lengths, 24)
  logits, cache = decode.prefill(model, params, tokens, lengths, 24, mesh=mesh)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
  placed = sharding.shard_params(params, mesh)["layers_0"]["attn"]
  assert spec(placed["k"]["kernel"]) == (None, kv_spec[1], None)
  assert spec(placed["q"]["kernel"]) == (None, "model", None)
  k = cache.layers["layers_0"]["attn"]["k"]  # [B, K, H, S]
  assert spec(k)[1:] == kv_spec[1:] and spec(k)[0] == ("data" if data > 1 else spec(k)[0])
  assert k.addressable_shards[0].data.shape == (
    4 // data,
    config.num_kv_heads // (model_axis if kv_spec[1] else 1),
    config.head_dim,
    24,  # max_len=24, a bucket's size (kvjax.cache.base.size_bucket)
  )
  # Greedy decoding step by step on one device is the reference for the sharded generate.
  step_tokens = np.argmax(np.asarray(ref_logits)[np.arange(4), lengths - 1], -1).astype(np.int32)
  greedy = [step_tokens]
  for _ in range(NEW_TOKENS - 1):
    ref_step, ref_cache = decode.decode_step(model, params, ref_cache, step_tokens)
    step, cache = decode.decode_step(model, params, cache, step_tokens, mesh=mesh)
    np.testing.assert_allclose(np.asarray(step), np.asarray(ref_step), atol=1e-5, rtol=0)
    step_tokens = np.argmax(np.asarray(ref_step), -1).astype(np.int32)
    greedy.append(step_tokens)
  ours = decode.generate(model, params, tokens, lengths, NEW_TOKENS, mesh=mesh)
  assert spec(ours)[0] == ("data" if data > 1 else None)
  np.testing.assert_array_equal(np.asarray(ours), np.stack(greedy, axis=1))


@pytest.mark.parametrize("cache_dtype", ["int8", "int4"])
def test_quantized_cache_on_a_mesh_matches_one_device(cache_dtype):
  """Prefill and decode steps over a quantized cache on data=2 x model=4: the one-device logits,
  with the scales split like their kv heads (rows on data, kv heads on model)."""
  config, cache_config = KV8, CacheConfig(dtype=cache_dtype)
  mesh = sharding.make_mesh(data=2, model=4)
  model, params = init(config)
  tokens, lengths = prompts(4, 9, config.vocab_size)
  ref_logits, ref_cache = decode.prefill(model, params, tokens, lengths, 24, cache_config=cache_config)
  logits, cache = decode.prefill(model, params, tokens, lengths, 24, mesh=mesh, cache_config=cache_config)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
  for name in ("k", "v", "k_scale", "v_scale"):
    x = cache.layers["layers_0"]["attn"][name]
    assert spec(x)[:2] == ("data", "model") and x.addressable_shards[0].data.shape[:2] == (2, 2), name
  step_tokens = tokens[:, 0]
  for _ in range(3):
    ref_step, ref_cache = decode.decode_step(model, params, ref_cache, step_tokens)
    step, cache = decode.decode_step(model, params, cache, step_tokens, mesh=mesh)
    np.testing.assert_allclose(np.asarray(step), np.asarray(ref_step), atol=1e-5, rtol=0)
    step_tokens = np.argmax(np.asarray(ref_step), -1).astype(np.int32)


@pytest.mark.parametrize(
  "cache_config",
  [CacheConfig(), CacheConfig(layout="paged", page_size=8, dtype="int8")],
  ids=["contiguous", "paged-int8"],
)
def test_mla_decode_on_a_mesh_matches_one_device(cache_config):
  """An MLA model on data=2 x model=4: prefill, decode steps and generate give the one-device
  logits and greedy tokens. Its latent cache is never split along the sequence: a contiguous
  cache's latent and rotary key [B, 1, S, W] split their rows over `data` only (the one latent
  "head" does not divide over `model`), so every device holds its rows' whole sequence; a paged
  cache's pools [1, P, Z, W] (and int8 scales) are whole on every device."""
  mesh = sharding.make_mesh(data=2, model=4)
  model, params = init(MLA)
  tokens, lengths = prompts(4, 9, MLA.vocab_size)
  ref_logits, ref_cache = decode.prefill(model, params, tokens, lengths, 24, cache_config=cache_config)
  logits, cache = decode.prefill(model, params, tokens, lengths, 24, mesh=mesh, cache_config=cache_config)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
  layer = cache.layers["layers_0"]["attn"]
  assert sorted(layer) == (
    ["latent", "rope_key"] if cache_config.dtype is None else ["latent", "latent_scale", "rope_key", "rope_key_scale"]
  )
  for name, x in layer.items():
    shard = x.addressable_shards[0].data.shape
    # max_len=24 is a bucket's size (kvjax.cache.base.size_bucket): 24 positions, 3 pages of 8 per row and the null page
    if cache_config.layout == "contiguous":  # [B, 1, S, W]
      assert spec(x) == ("data", None, None, None) and shard == (2, 1, 24, x.shape[3]), name
    else:  # [1, P, Z, ...]
      assert spec(x) == (None,) * x.ndim and shard == x.shape and x.shape[1:3] == (13, 8), name
  step_tokens = np.argmax(np.asarray(ref_logits)[np.arange(4), lengths - 1], -1).astype(np.int32)
  greedy = [step_tokens]
  for _ in range(NEW_TOKENS - 1):
    ref_step, ref_cache = decode.decode_step(model, params, ref_cache, step_tokens)
    step, cache = decode.decode_step(model, params, cache, step_tokens, mesh=mesh)
    np.testing.assert_allclose(np.asarray(step), np.asarray(ref_step), atol=1e-5, rtol=0)
    step_tokens = np.argmax(np.asarray(ref_step), -1).astype(np.int32)
    greedy.append(step_tokens)
  assert spec(cache.layers["layers_0"]["attn"]["latent"])[2] is None  # the steps keep the sequence whole
  ours = decode.generate(model, params, tokens, lengths, NEW_TOKENS, mesh=mesh, cache_config=cache_config)
  np.testing.assert_array_equal(np.asarray(ours), np.stack(greedy, axis=1))


def test_decode_step_with_8_kv_heads_on_model_8_gathers_no_kv():
  mesh = sharding.make_mesh(data=1, model=8)
  model, params = init(KV8)
  tokens, lengths = prompts(2, 6, KV8.vocab_size)
  _, cache = decode.prefill(model, params, tokens, lengths, 16, mesh=mesh)
  params, (step_tokens,) = sharding.place(mesh, params, np.zeros(2, np.int32))
  hlo = (
    decode._forward.lower(model, params, cache, step_tokens[:, None], jnp.ones(2, jnp.int32), last=True)
    .compile()
    .as_text()
  )
  # Each device's cache is its own kv head: the compiled module's cache parameters are
  # [B, 1, H, S] and [B, 1, S, H] shards of the k [B, 8, H, S] and v [B, 8, S, H] caches.
  entry_inputs = re.search(r"ENTRY [^(]*\((.*?)\) ->", hlo).group(1)
  assert entry_inputs.count("f32[2,1,8,16]") == entry_inputs.count("f32[2,1,16,8]") == KV8.num_layers, entry_inputs
  assert "f32[2,8,16,8]" not in hlo and "f32[2,8,8,16]" not in hlo
  # Attention tensors (K/V, queries, scores) are rank >= 4; none is all-gathered. The
  # collectives left are the row-parallel reductions (attention output, MLP down, embedding).
  gathers = re.findall(r"= \w+\[([0-9,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
  assert not [g for g in gathers if g.count(",") >= 3], gathers
  assert "all-reduce" in hlo


def test_train_step_matches_one_device():
  mesh = sharding.make_mesh(data=2, model=4)
  model, _ = init(KV8)
  # Sharded sums add in another order; Adam's g / sqrt(v) turns those last-bit differences of
  # near-zero gradients into whole-step ones unless eps dominates them.
  optimizer = optax.adamw(1e-3, eps=1e-4)

  def fresh():
    params = jax.device_put(init(KV8)[1])
    return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))

  rng = np.random.default_rng(1)
  batches = [rng.integers(0, KV8.vocab_size, (4, 17)).astype(np.int32) for _ in range(2)]
  step_fn = make_train_step(model, optimizer)
  ref, sharded = fresh(), sharding.shard_params(fresh(), mesh)
  before = jax.tree.map(spec, sharded.params)
  for batch in batches:
    ref, ref_metrics = step_fn(ref, batch[:, :-1], batch[:, 1:])
    inputs, targets = sharding.shard_batch(mesh, batch[:, :-1], batch[:, 1:])
    sharded, metrics = step_fn(sharded, inputs, targets)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5)
  q = sharded.params["layers_0"]["attn"]["q"]["kernel"]
  assert spec(q) == (None, "model", None)
  assert jax.tree.map(spec, sharded.params) == before  # the step keeps the layout it was given
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0), sharded.params, ref.params
  )


TINY = str(Path(__file__).resolve().parent.parent / "configs" / "train" / "tiny.py")
# tiny.py cut to one layer and 4 steps (all inside its warmup, so a 2-step run's schedule, and
# compiled step, are the 4-step run's); 4 heads over model=4 put one kv head on each device.
SMALL = [
  "train.steps=4",
  "model.num_layers=1",
  "data.max_bytes=200000",
  "data.seq_len=32",
  "train.batch_size=8",
  "train.eval_batches=1",
]


def test_kvjax_run_on_a_mesh_matches_one_device(tmp_path, monkeypatch, capsys):
  steps, layouts = [], []  # each run's jitted train step; (q kernel, inputs) mesh specs at each call
  make = train.make_train_step

  def recording(*args, **kwargs):
    compiled = make(*args, **kwargs)
    steps.append(compiled)

    def step(state, inputs, targets):
      layouts.append((layout(state.params["layers_0"]["attn"]["q"]["kernel"]), layout(inputs)))
      return compiled(state, inputs, targets)

    return step

  monkeypatch.setattr(train, "make_train_step", recording)
  on_mesh = ((None, "model", None), ("data", None))

  def kvjax(*args) -> str:
    assert cli.main(list(args)) == 0
    return capsys.readouterr().out

  def run(name: str, *args, overrides=()) -> tuple[dict, str]:
    out = kvjax("run", TINY, "--workdir", str(tmp_path / name), "--set", *SMALL, *overrides, *args)
    return checkpoint.load_model(tmp_path / name)[1], out

  def assert_close(params, ref):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0), params, ref)

  ref, out = run("one_device")
  ref_val = json.loads(out.splitlines()[-1])["val_loss"]
  assert layouts == [(None, None)] * 4
  layouts.clear()
  sharded, out = run("mesh", "--mesh", "data=2,model=4")
  assert "on a mesh of {'data': 2, 'model': 4}" in out
  assert layouts == [on_mesh] * 4
  assert steps[-1].jitted._cache_size() == 1  # one compiled step for the whole sharded run
  assert_close(sharded, ref)
  np.testing.assert_allclose(json.loads(out.splitlines()[-1])["val_loss"], ref_val, rtol=1e-5)

  # A one-device checkpoint resumes onto the mesh and trains on to the same parameters.
  run("resumed", overrides=["train.steps=2"])
  layouts.clear()
  resumed, out = run("resumed", "--mesh", "data=2,model=4")
  assert "resuming at step 2, on a mesh of {'data': 2, 'model': 4}" in out
  assert layouts == [on_mesh] * 2
  assert_close(resumed, ref)

  # The sharded checkpoint is read straight onto another mesh; `kvjax eval --mesh` scores it as
  # the run's own evaluation did.
  other = sharding.make_mesh(data=1, model=8)
  _, params, _ = checkpoint.load_model(tmp_path / "mesh", mesh=other)
  assert spec(params["embed"]["embedding"]) == ("model", None)
  assert spec(params["layers_0"]["attn"]["k"]["kernel"]) == (None, None, None)  # 4 kv heads < 8
  assert_close(params, sharded)
  result = json.loads(kvjax("eval", "--workdir", str(tmp_path / "mesh"), "--mesh", "data=2,model=4", "--json"))
  np.testing.assert_allclose(result["loss"], ref_val, rtol=1e-5)
