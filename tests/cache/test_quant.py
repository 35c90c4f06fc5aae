"""Oracles for the quantized caches (kvjax.cache.quant): the codec's error bound, decoding over a
quantized cache == decoding over a float cache of its dequantized values, paged == contiguous,
exact byte counts, and bad input refused."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import memory
from kvjax.cache import quant
from kvjax.cache.contiguous import dequantized
from kvjax.fields import CACHE_DTYPES, QUANTIZED_CACHE_DTYPES, cache_bytes_per_head
from kvjax.interop import kv_size
from kvjax.model.transformer import cache_collection, cache_layers
from conftest import init_params, tiny_config

FORMATS = QUANTIZED_CACHE_DTYPES
LENGTHS = np.array([10, 4, 7])
STEPS = 5
# Largest |logit| difference from the float32 cache over a ragged prefill and STEPS decode steps
# of the tiny random model (logits of standard deviation ~1); measured 0.008 (int8), 0.14 (int4),
# 0.04 (fp8).
FLOAT_TOLERANCE = {"int8": 0.03, "int4": 0.4, "float8_e4m3fn": 0.1}


@functools.cache
def model_params(cache_dtype: str = "float32"):
  model, params = init_params(tiny_config(2))
  return kvjax.Transformer(model.config.replace(cache_dtype=cache_dtype)), params


def sequences():
  seqs = np.random.default_rng(1).integers(0, 64, (3, 10 + STEPS)).astype(np.int32)
  prompts = np.where(np.arange(10)[None] < LENGTHS[:, None], seqs[:, :10], 0)
  return seqs, prompts


def half_step(x: np.ndarray, values: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
  """Half the quantization step at each element of x [..., H], from its stored scale."""
  if fmt == "int4":
    group = x.shape[-1] // scale.shape[-1]
    return np.repeat(scale, group, axis=-1) / 2
  scale = scale[..., None]
  if fmt == "int8":
    return np.broadcast_to(scale / 2, x.shape)
  # e4m3: 3 mantissa bits; spacing 2^(e - 3) in the binade [2^e, 2^(e + 1)), 2^-9 below 2^-6.
  y = np.abs(x / np.where(scale > 0, scale, 1))
  exponent = np.floor(np.log2(np.maximum(y, 2.0 ** -6)))
  return 2.0 ** (exponent - 3) / 2 * scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_error_within_half_a_step(fmt):
  """Per element |x - dequantize(quantize(x))| <= half a step (to float32 rounding), at every
  magnitude; an all-zero vector (an empty slot) decodes to zeros."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 3, 6, 64)) * 10.0 ** rng.uniform(-3, 2, (4, 3, 6, 1))  # [B, K, T, H]
  x[0, 0, 0] = 0
  x = x.astype(np.float32)
  values, scale = quant.quantize(jnp.asarray(x), fmt)
  assert values.dtype == quant.STORED[fmt]
  groups = 2 if fmt == "int4" else None  # int4 groups of 32 along head_dim 64
  assert values.shape == (4, 3, 6, 32 if fmt == "int4" else 64)
  assert scale.shape == ((4, 3, 6, groups) if groups else (4, 3, 6)) and scale.dtype == jnp.float32
  back = np.asarray(quant.dequantize(values, scale, fmt))
  bound = half_step(x, np.asarray(values), np.asarray(scale), fmt)
  assert (np.abs(back - x) <= bound * (1 + 1e-5)).all()
  assert not back[0, 0, 0].any()
  # The head axis may sit elsewhere (the contiguous cache's keys [B, K, H, S]): same values.
  moved = quant.dequantize(values.swapaxes(2, 3), scale.swapaxes(2, 3) if groups else scale, fmt, axis=2)
  np.testing.assert_array_equal(np.asarray(moved).swapaxes(2, 3), back)


class RoundtripCache(kvjax.ContiguousCache):
  """A float32 contiguous cache storing what the quantized format `fmt` reads back of each write:
  the float reference for decoding over a quantized cache."""

  fmt: str = flax.struct.field(pytree_node=False, default="int8")

  def write(self, stored, k, v, span):
    return super().write(stored, quant.roundtrip(k, self.fmt), quant.roundtrip(v, self.fmt), span)


def float_layers(config, cache) -> dict:
  """A quantized contiguous cache's layers as float32 k [B, K, H, S], v [B, K, S, H]."""
  layers = cache_layers(cache.layers)
  def layer(i):
    k, v = dequantized(layers[i]["k"], layers[i]["v"], layers[i]["k_scale"], layers[i]["v_scale"])
    return {"k": k, "v": v}
  return cache_collection(config, layer)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_equals_float_cache_of_the_dequantized_values(fmt):
  """Ragged prefill, then STEPS decode steps. Over the quantized cache the logits equal (to 1e-5,
  float rounding) those over a float32 cache holding its dequantized values whose writes store
  what the format reads back, and both caches end up holding the same values. Within
  FLOAT_TOLERANCE of the float cache."""
  model, params = model_params(fmt)
  float_model, _ = model_params()
  seqs, prompts = sequences()
  logits, cache = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32)
  float_logits, float_cache = kvjax.prefill(float_model, params, prompts, LENGTHS, max_len=32)
  worst = float(np.abs(logits - float_logits)[np.arange(10)[None] < LENGTHS[:, None]].max())

  reference = RoundtripCache(layers=float_layers(model.config, cache), lengths=jnp.array(cache.lengths), fmt=fmt)
  for step in range(STEPS):
    tokens = seqs[np.arange(3), LENGTHS + step]
    got, cache = kvjax.decode_step(model, params, cache, tokens)
    want, reference = kvjax.decode_step(float_model, params, reference, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    exact, float_cache = kvjax.decode_step(float_model, params, float_cache, tokens)
    worst = max(worst, float(np.abs(got - exact).max()))
  # Layer 0's K/V depend on the tokens alone, so the two caches hold them bit for bit; deeper
  # layers' inputs differ by the float rounding of the attention above them.
  ours, theirs = cache_layers(float_layers(model.config, cache)), cache_layers(reference.layers)
  for name in ("k", "v"):
    np.testing.assert_array_equal(ours[0][name], theirs[0][name])
    np.testing.assert_allclose(ours[-1][name], theirs[-1][name], atol=1e-5, rtol=0)
  assert worst <= FLOAT_TOLERANCE[fmt], worst


@pytest.mark.parametrize("fmt", FORMATS + ("bfloat16",))
def test_prefill_attends_to_its_keys_as_the_cache_stores_them(fmt):
  """A prefill's last position gives the logits of the same token decoded after prefilling the
  rest, which reads the stored (quantized, or rounded to bfloat16) K/V of the earlier tokens."""
  model, params = model_params(fmt)
  _, prompts = sequences()
  logits, _ = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32)
  _, shorter = kvjax.prefill(model, params, prompts, LENGTHS - 1, max_len=32)
  last, _ = kvjax.decode_step(model, params, shorter, prompts[np.arange(3), LENGTHS - 1])
  np.testing.assert_allclose(last, logits[np.arange(3), LENGTHS - 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_matches_contiguous(fmt):
  """Ragged prefill and decode steps through scattered pages give the contiguous cache's logits;
  copy_pages copies the scale pools with the values."""
  model, params = model_params(fmt)
  seqs, prompts = sequences()
  table = np.random.default_rng(0).permutation(np.arange(1, 30))[:24].reshape(3, 8).astype(np.int32)
  paged = kvjax.PagedCache.create(model.config, 30, 4, 3, 8).with_rows(table, np.zeros(3, np.int32))
  want, contiguous = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32)
  got, paged = kvjax.extend(model, params, paged, prompts, LENGTHS)
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(got[row, :n], want[row, :n], atol=1e-5, rtol=0)
  for step in range(3):
    tokens = seqs[np.arange(3), LENGTHS + step]
    want, contiguous = kvjax.decode_step(model, params, contiguous, tokens)
    got, paged = kvjax.decode_step(model, params, paged, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  spare = int(np.setdiff1d(np.arange(1, 30), table)[0])
  layers = jax.tree.map(np.asarray, cache_layers(paged.layers))
  copied = paged.copy_pages([table[0, 0]], [spare])  # donates paged's pools
  for before, after in zip(layers, cache_layers(copied.layers)):
    assert sorted(after) == ["k", "k_scale", "v", "v_scale"]
    for name in after:
      np.testing.assert_array_equal(after[name][:, spare], before[name][:, table[0, 0]])


@pytest.mark.parametrize("window", [(), (4, 0)], ids=["global", "windowed"])
def test_engine_and_generate_agree_on_a_quantized_cache(window):
  """The engine (paged, continuous batching) gives generate's greedy tokens (the contiguous
  cache, a ring in a windowed layer) with an int8 cache, with and without a sliding-window layer
  whose window the rows pass."""
  model, params = model_params("int8")
  model = kvjax.Transformer(model.config.replace(window=window, sink_tokens=1 if window else 0))
  _, prompts = sequences()
  engine = kvjax.Engine(model, params, kvjax.EngineConfig(num_slots=2, num_pages=24, page_size=4, max_len=32))
  for row in range(3):
    engine.submit(prompts[row, :LENGTHS[row]], 6)
  outputs = engine.run()
  want = kvjax.generate(model, params, prompts, LENGTHS, 6)
  for row in range(3):
    np.testing.assert_array_equal(outputs[row], want[row])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_byte_counts_are_exact(cache_dtype):
  """nbytes of every kind == ModelConfig.kv_bytes_per_token x positions, which counts values and
  scales by hand here; memory's estimates and the planner agree."""
  config = kvjax.ModelConfig(vocab_size=64, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=64, max_len=32, cache_dtype=cache_dtype)
  per_head = {"float32": 256, "bfloat16": 128, "float16": 128, "int8": 64 + 4, "float8_e4m3fn": 64 + 4,
              "int4": 32 + 4 * 2}[cache_dtype]
  assert config.kv_bytes_per_token == 2 * 2 * 2 * per_head == 2 * 2 * 2 * cache_bytes_per_head(cache_dtype, 64)
  contiguous = kvjax.ContiguousCache.create(config, 3, 20)
  assert contiguous.nbytes == 3 * 20 * config.kv_bytes_per_token
  assert memory.contiguous_cache_bytes(config, 3, 20) == contiguous.nbytes + 4 * 3
  paged = kvjax.PagedCache.create(config, 9, 4, 2, 5)
  assert paged.nbytes == 9 * 4 * config.kv_bytes_per_token
  assert memory.paged_cache_bytes(config, 9, 4, 2, 5) == paged.nbytes + 4 * 2 * 6
  arch = kv_size.from_model_config("m", config)
  assert kv_size.plan(arch, context=20, batch=3, dtype=cache_dtype)["cache_bytes"] == contiguous.nbytes
  contiguous.check_model(config)
  paged.check_model(config)


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match=r"ModelConfig.cache_dtype must be one of .*'int4'.*got 'int3'"):
    tiny_config(cache_dtype="int3")
  with pytest.raises(ValueError, match="even head_dim; got head_dim=9"):
    tiny_config(positions="learned", d_model=36, cache_dtype="int4")
  model, params = model_params()
  int8_cache = kvjax.ContiguousCache.create(model_params("int8")[0].config, 3, 16)
  with pytest.raises(ValueError, match="does not fit the model: layer 0 k .*cache_dtype=float32"):
    kvjax.decode_step(model, params, int8_cache, np.zeros(3, np.int32))
  with pytest.raises(ValueError, match="attention='pallas_interpret' reads float pools only"):
    kvjax.PagedCache.create(model_params("int4")[0].config, 4, 4, 1, 2, attention="pallas_interpret")
  with pytest.raises(ValueError, match="quantize takes one of"):
    quant.quantize(jnp.zeros((2, 8)), "bfloat16")
  with pytest.raises(ValueError, match="dtype 'int3'"):
    kv_size.plan(kv_size.PRESETS["GPT-2"], context=1, batch=1, dtype="int3")
