"""Memory budgets: the estimates against known numbers and XLA's own plan, and refusals that come
before anything is traced or allocated, with the estimate and the limit in the message."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kvjax import memory
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.paged import PagedCache
from kvjax.config import ModelConfig
from kvjax.model.params import abstract_params, param_count
from kvjax.model.transformer import Transformer
from kvjax.training import train
from kvjax.training.step import init_state, make_optimizer, make_train_step
from kvjax.training.config import DataConfig, TrainConfig, TrainRun

ROOT = Path(__file__).resolve().parents[1]
# configs/train/tiny.py's model.
TINY = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=192, max_len=128)


def counted_by_hand(config: ModelConfig) -> int:
  """Weights of Transformer(config) from the architecture: embeddings, per layer two norms, the
  attention's projections (MLA: q, kv_down, k_rope, k_up, v_up, out) and the MLP, a final norm."""
  d, n, k, h, f = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim
  norm = d if config.norm == "rmsnorm" else 2 * d  # LayerNorm has a bias beside its scale
  if config.is_latent:
    r, w = config.kv_latent_rank, config.rope_dims
    attn = (
      2 * d * n * h
      + d * (r + w)
      + r * n * (2 * h - config.rope_group_dims)
      + (n * h + r + w if config.qkv_bias else 0)
      + (d if config.use_bias else 0)
    )
  else:
    attn = d * h * (2 * n + 2 * k) + (h * (n + 2 * k) if config.qkv_bias else 0) + (d if config.use_bias else 0)
  projections = 3 if config.activation == "swiglu" else 2
  mlp = projections * d * f + ((projections - 1) * f + d if config.use_bias else 0)
  total = config.vocab_size * d + config.num_layers * (2 * norm + attn + mlp) + norm
  total += config.max_len * d if config.positions == "learned" else 0
  return total + (0 if config.tie_embeddings else d * config.vocab_size)


def test_param_count_is_the_size_of_the_parameter_tree():
  configs = [
    ModelConfig(
      vocab_size=50,
      d_model=24,
      num_layers=3,
      num_heads=6,
      num_kv_heads=2,
      head_dim=6,
      mlp_dim=40,
      activation=activation,
      norm=norm,
      positions=positions,
      qkv_bias=qkv_bias,
      use_bias=use_bias,
      tie_embeddings=tie,
      max_len=17,
    )
    for activation, norm, positions, qkv_bias, use_bias, tie in itertools.product(
      ("swiglu", "gelu"), ("rmsnorm", "layernorm"), ("rope", "learned"), *[(False, True)] * 3
    )
  ]
  # MLA changes only the attention's weights: with and without biases and a rotary key.
  configs += [
    c.replace(kv_latent_rank=10, rope_dims=4 if c.positions == "rope" else 0)
    for c in configs
    if (c.activation, c.norm, c.tie_embeddings) == ("swiglu", "rmsnorm", False)
  ]
  for config in configs:
    assert param_count(config) == counted_by_hand(config), config
  # And the tree init builds, leaf by leaf.
  built = Transformer(TINY).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  assert param_count(TINY) == sum(x.size for x in jax.tree.leaves(built)) == counted_by_hand(TINY)


def test_training_estimate_of_the_tiny_config():
  # embed 256*64 + 2 layers * (norms 2*64 + q,k,v,out 4*64*64 + MLP 3*64*192) + final norm 64 + lm_head 64*256
  assert param_count(TINY) == 16384 + 2 * (128 + 16384 + 36864) + 64 + 16384 == 139_584
  # Per token: 2 layers * (4D + 3NH + 4KH + 6F + 4NT) + 2D + 3V floats, for 16 x 64 tokens.
  activations = 4 * 16 * 64 * (2 * (256 + 192 + 256 + 1152 + 4 * 4 * 64) + 128 + 768)
  assert memory.train_parts(TINY, 16, 64) == {
    "parameters": 558_336,
    "gradients": 558_336,
    "AdamW moments": 1_116_672,
    "activations for 16 x 64 tokens": activations,
  }
  assert memory.train_bytes(TINY, 16, 64) == 2_233_344 + activations == 29_496_320


@pytest.mark.parametrize(
  "config, batch, seq_len",
  [
    (TINY, 16, 64),
    (ModelConfig(vocab_size=1000, d_model=128, num_layers=4, num_heads=8, num_kv_heads=2, max_len=256), 8, 256),
    (
      ModelConfig(
        vocab_size=256,
        d_model=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        activation="gelu",
        norm="layernorm",
        positions="learned",
        use_bias=True,
        qkv_bias=True,
        max_len=512,
      ),
      4,
      512,
    ),
  ],
  ids=["tiny", "gqa", "gpt2_like"],
)
def test_training_estimate_bounds_what_xla_plans(config, batch, seq_len):
  model, optimizer = Transformer(config), make_optimizer(TrainConfig())
  state = jax.eval_shape(functools.partial(init_state, model, optimizer), jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  plan = make_train_step(model, optimizer).lower(state, tokens, tokens).compile().memory_analysis()
  if plan is None:
    pytest.skip("this backend gives no memory analysis")
  used = plan.argument_size_in_bytes + plan.output_size_in_bytes - plan.alias_size_in_bytes + plan.temp_size_in_bytes
  assert used <= memory.train_bytes(config, batch, seq_len) <= 2 * used


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "float8_e4m3fn"])
@pytest.mark.parametrize("model", ["kv", "kv_windowed", "mla_windowed"])
def test_cache_estimates_are_the_caches_sizes(model, dtype):
  """The sizes the caches' create checks against the free memory are those of what they allocate:
  every array, the bookkeeping (lengths, page table) included."""
  config = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, max_len=64)
  config = config.replace(window=(8, 0), sink_tokens=2) if model.endswith("windowed") else config
  config = config.replace(kv_latent_rank=16, rope_dims=4) if model.startswith("mla") else config
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  for layout in ("contiguous", "paged"):
    cache_config = CacheConfig(layout=layout, dtype=dtype, page_size=8)
    cache = jax.eval_shape(lambda: kinds.create(config, cache_config, 5, 48))
    assert kinds.cache_bytes(config, cache_config, 5, 48) == nbytes(cache), layout
  cache_config = CacheConfig(layout="paged", dtype=dtype)
  paged = jax.eval_shape(lambda: PagedCache.create(config, 9, 8, 3, 4, cache_config))
  assert PagedCache.pool_bytes(config, cache_config, 9, 8, 3, 4) == nbytes(paged)
  # By hand, for K/V without windows: 5 rows x 48 positions x 3 layers x K and V x 2 kv heads x
  # 8 dims through the codec (bytes per vector, scales included), and 4 bytes of length a row.
  vector = {"bfloat16": 16, "int8": 8 + 4, "int4": 4 + 2 * 4, "float8_e4m3fn": 8 + 4}[dtype]
  if model == "kv":
    assert kinds.cache_bytes(config, CacheConfig(dtype=dtype), 5, 48) == 5 * 48 * 3 * 2 * 2 * vector + 4 * 5


def test_check_fits_gives_the_estimate_and_the_limit():
  memory.check_fits("a job", 1000, limit=1000)
  with pytest.raises(
    ValueError,
    match=r"^a job needs about 1\.5 KB, more than the 1\.0 KB of the given "
    r"limit; refused before allocating$",
  ):
    memory.check_fits("a job", 1500, limit=1000)
  with pytest.raises(
    ValueError,
    match=r"training \(139,584 parameters\) needs about 29\.5 MB \(parameters "
    r"558\.3 KB \+ gradients 558\.3 KB \+ AdamW moments 1\.1 MB \+ "
    r"activations for 16 x 64 tokens 27\.3 MB\), more than the 10\.0 MB",
  ):
    memory.check_training(TINY, 16, 64, limit=10**7)
  memory.check_training(TINY, 16, 64, limit=memory.train_bytes(TINY, 16, 64))
  # Weights already in memory are not counted twice.
  memory.check_training(TINY, 16, 64, limit=memory.train_bytes(TINY, 16, 64) - 1000, resident=1000)


class FakeAccelerator:
  platform, device_kind = "gpu", "H200"

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_the_memory_a_job_has():
  host = memory.device_limit()  # the CPU backend: host RAM
  assert host is not None and host.bytes > 0 and "host RAM" in host.source
  assert memory.available_bytes() > 0
  two = [FakeAccelerator({"bytes_limit": 100, "bytes_in_use": 30}), FakeAccelerator({"bytes_limit": 100})]
  assert memory.available_bytes(two) == 170
  assert "H200 x 2" in memory.device_limit(two).source
  assert memory.available_bytes([FakeAccelerator(None)]) is None
  with pytest.raises(ValueError, match="170 bytes of free memory of H200 x 2"):
    memory.check_fits("a job", 171, devices=two)
  # Unknown limits still refuse what XLA cannot address (which would abort the process).
  memory.check_fits("a job", 10**15, devices=[FakeAccelerator(None)])
  with pytest.raises(ValueError, match="largest size XLA can address"):
    memory.check_fits("a job", 2**63, devices=[FakeAccelerator(None)])


def _too_big(d_model: int) -> TrainRun:
  return TrainRun(
    model=TINY.replace(d_model=d_model, mlp_dim=None),
    data=DataConfig(source="stdlib", max_bytes=100_000, seq_len=64),
    train=TrainConfig(steps=2, batch_size=16),
  )


@pytest.mark.parametrize("d_model", [32768, 2**26])
def test_training_that_cannot_fit_is_refused_before_anything_is_written(d_model, tmp_path):
  config = _too_big(d_model)
  if memory.train_bytes(config.model, 16, 64) <= memory.available_bytes():
    pytest.skip("this machine could hold it")
  with pytest.raises(
    ValueError,
    match=r"training \([\d,]+ parameters\) needs about [\d.,]+ [EPTG]B .*"
    r"more than the [\d.,]+ [KMGT]?B of host RAM",
  ):
    train.run(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("d_model", ["32768", str(2**26)])
def test_kvjax_run_refuses_in_one_line(d_model, tmp_path):
  if memory.train_bytes(_too_big(32768).model, 16, 64) <= memory.available_bytes():
    pytest.skip("this machine could hold it")
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "kvjax.cli.main",
      "run",
      str(ROOT / "configs/train/tiny.py"),
      "--workdir",
      str(tmp_path / "run"),
      "--set",
      f"model.d_model={d_model}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and re.match(r"kvjax run: error: training \([\d,]+ parameters\) needs about", lines[0])
  assert not (tmp_path / "run").exists()  # refused before the workdir is claimed


def test_uptraining_that_cannot_fit_is_refused_before_loading(tmp_path, monkeypatch):
  from kvjax.conversion import uptrain as uptraining
  from kvjax.conversion.conversions import KVHeads
  from kvjax.training.checkpoint import save_params

  source = tmp_path / "source"
  params = jax.jit(lambda: Transformer(TINY).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))()
  save_params(source, params["params"], TINY)
  monkeypatch.setattr(uptraining.checkpoint, "load_model", lambda *a, **k: pytest.fail("loaded the source"))
  with pytest.raises(
    ValueError,
    match=r"uptraining needs about .*\(source parameters 558\.3 KB \+ parameters "
    r".* activations for 1000000 x 64 tokens",
  ):
    uptraining.uptrain(
      source, tmp_path / "gqa", KVHeads(2), overrides=["train.steps=1", "train.batch_size=1000000", "data.seq_len=64"]
    )
  assert not (tmp_path / "gqa").exists()


def test_import_of_a_model_too_large_for_host_memory_is_refused_before_reading(tmp_path):
  from kvjax.interop.importer import from_hf

  config = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=2**20,
    intermediate_size=2**22,
    num_hidden_layers=80,
    num_attention_heads=64,
    max_position_embeddings=4096,
  )
  (tmp_path / "config.json").write_text(json.dumps(config))  # and no weights at all
  with pytest.raises(
    ValueError,
    match=rf"importing {re.escape(str(tmp_path))} needs about [\d.,]+ PB "
    r"\(float32 parameters",
  ):
    from_hf(tmp_path)


def test_forward_estimate_bounds_what_xla_plans():
  config = ModelConfig(vocab_size=1000, d_model=128, num_layers=4, num_heads=8, num_kv_heads=2, max_len=256)
  forward = jax.jit(lambda p, x: Transformer(config).apply({"params": p}, x))
  plan = forward.lower(abstract_params(config), jax.ShapeDtypeStruct((8, 256), jnp.int32)).compile().memory_analysis()
  if plan is None:
    pytest.skip("this backend gives no memory analysis")
  assert plan.temp_size_in_bytes + plan.output_size_in_bytes <= memory.forward_bytes(config, 8, 256)
  # A prefill that keeps the last position's logits (generate's) is bounded by the estimate for one.
  at = jnp.full((8, 1), 255, jnp.int32)
  last = jax.jit(lambda p, x: Transformer(config).apply({"params": p}, x, logits_at=at))
  plan = last.lower(abstract_params(config), jax.ShapeDtypeStruct((8, 256), jnp.int32)).compile().memory_analysis()
  estimate = memory.forward_bytes(config, 8, 256, logits=1)
  assert plan.temp_size_in_bytes + plan.output_size_in_bytes <= estimate < memory.forward_bytes(config, 8, 256)


def resident_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set from /proc")
def test_release_free_gives_a_freed_heap_back():
  """200 MB of small heap blocks, freed but for every 100th (so the heap cannot shrink from its
  end): the C library keeps the freed pages resident until release_free hands them back."""
  blocks = [bytearray(2000) for _ in range(100_000)]
  for block in blocks:
    block[::512] = b"x" * len(block[::512])  # touch every page
  kept = blocks[::100]
  del blocks
  before = resident_bytes()
  assert memory.release_free()
  assert before - resident_bytes() > 100 * 2**20
  assert len(kept) == 1000
