"""Oracles for the codecs (kvjax.cache.codec) and the K/V caches that store through them: each
codec's error bound at every magnitude, decoding over a quantized cache == decoding over a float
cache of its dequantized values, paged == contiguous, the engine == generate, exact byte counts.
The latent payload through the same codecs: tests/cache/test_latent.py."""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cache.codec import NAMES, QUANTIZED, Codec, codec, int4_group_size
from kvjax.cache.config import CacheConfig
from kvjax.model.transformer import cache_collection, cache_layers
from conftest import init_params, tiny_config

LENGTHS = np.array([10, 4, 7])
STEPS = 5
# Largest |logit| difference from the float32 cache over a ragged prefill and STEPS decode steps
# of the tiny random model (logits of standard deviation ~1); measured 0.008 (int8), 0.14 (int4),
# 0.04 (fp8).
FLOAT_TOLERANCE = {"int8": 0.03, "int4": 0.4, "float8_e4m3fn": 0.1}


@functools.cache
def model_params():
  return init_params(tiny_config(2))


def contiguous(fmt: str) -> CacheConfig:
  return CacheConfig(dtype=fmt)


def paged(fmt: str) -> CacheConfig:
  return CacheConfig(layout="paged", page_size=4, dtype=fmt)


def sequences():
  seqs = np.random.default_rng(1).integers(0, 64, (3, 10 + STEPS)).astype(np.int32)
  prompts = np.where(np.arange(10)[None] < LENGTHS[:, None], seqs[:, :10], 0)
  return seqs, prompts


def half_step(x: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
  """Half the quantization step at each element of x [..., W], from its stored scale."""
  if fmt == "int4":  # the steps, then the zero points
    step = scale[..., : scale.shape[-1] // 2]
    return np.repeat(step, x.shape[-1] // step.shape[-1], axis=-1) / 2
  scale = scale[..., None]
  if fmt == "int8":
    return np.broadcast_to(scale / 2, x.shape)
  # e4m3: 3 mantissa bits; spacing 2^(e - 3) in the binade [2^e, 2^(e + 1)), 2^-9 below 2^-6.
  y = np.abs(x / np.where(scale > 0, scale, 1))
  exponent = np.floor(np.log2(np.maximum(y, 2.0**-6)))
  return 2.0 ** (exponent - 3) / 2 * scale


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("width", [64, 12])
def test_roundtrip_error_within_half_a_step(fmt, width):
  """Per element |x - decode(encode(x))| <= half a step (to float32 rounding), at every magnitude,
  for a head's width (64) and an MLA latent's (12, one int4 group); an all-zero vector (an empty
  slot) decodes to zeros; roundtrip is decode(encode(x))."""
  c = codec(fmt)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 3, 6, width)) * 10.0 ** rng.uniform(-3, 2, (4, 3, 6, 1))  # [B, K, T, W]
  x[0, 0, 0] = 0
  x = x.astype(np.float32)
  values, scale = c.encode(jnp.asarray(x))
  assert values.dtype == c.stored_dtype == {"int8": np.int8, "int4": np.uint8, "float8_e4m3fn": np.uint8}[fmt]
  groups = 2 * (width // int4_group_size(width)) if fmt == "int4" else None
  assert values.shape == (4, 3, 6, width // 2 if fmt == "int4" else width)
  assert scale.shape == ((4, 3, 6, groups) if groups else (4, 3, 6)) and scale.dtype == jnp.float32
  back = np.asarray(c.decode(values, scale))
  bound = half_step(x, np.asarray(scale), fmt)
  assert (np.abs(back - x) <= bound * (1 + 1e-5)).all()
  assert not back[0, 0, 0].any()
  assert np.abs(back - x).max() > 0  # the codec does lose something: the bound is what is checked
  np.testing.assert_array_equal(np.asarray(c.roundtrip(jnp.asarray(x))), back)
  # The width axis may sit elsewhere (the contiguous cache's keys [B, K, W, S]): same values.
  moved = c.decode(values.swapaxes(2, 3), scale.swapaxes(2, 3) if groups else scale, axis=2)
  np.testing.assert_array_equal(np.asarray(moved).swapaxes(2, 3), back)


def test_float_codecs_cast_and_names_resolve():
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 8)), jnp.float32)
  for name in ("float32", "bfloat16", "float16"):
    values, scale = codec(name).encode(x)
    stored = np.uint16 if name == "bfloat16" else name  # bfloat16 as its bits: a write moves only them
    assert scale is None and values.dtype == jnp.dtype(stored) == codec(name).stored_dtype
    np.testing.assert_array_equal(codec(name).roundtrip(x), x.astype(name).astype(jnp.float32))
  assert [codec(a).name for a in ("fp32", "bf16", "fp16", "fp8")] == ["float32", "bfloat16", "float16", "float8_e4m3fn"]
  assert set(NAMES) == {"float32", "bfloat16", "float16", "int8", "int4", "float8_e4m3fn"}
  assert set(QUANTIZED) == {"int8", "int4", "float8_e4m3fn"}
  # Values and float32 scales per vector, by hand: int4 packs two per byte with a step and a zero point per group.
  assert [codec(n).vector_bytes(64) for n in NAMES] == [256, 128, 128, 64 + 4, 32 + 2 * 4 * 2, 64 + 4]
  assert [int4_group_size(w) for w in (2, 8, 12, 64, 96, 40)] == [2, 8, 12, 32, 32, 20]
  with pytest.raises(ValueError, match=r"cache dtype must be one of .*'int4'.*got 'int3'"):
    codec("int3")


class RoundtripCache(kvjax.ContiguousCache):
  """A float32 contiguous cache storing what the codec `stored_as` reads back of each write:
  the float reference for decoding over a quantized cache."""

  stored_as: Codec = flax.struct.field(pytree_node=False, default=codec("int8"))

  def write(self, stored, new, span):
    return super().write(stored, {name: self.stored_as.roundtrip(x) for name, x in new.items()}, span)


def float_layers(config, cache) -> dict:
  """A quantized contiguous cache's layers decoded: float32 k [B, K, H, S], v [B, K, S, H]."""
  layers = cache_layers(cache.layers)
  return cache_collection(config, lambda i: cache.readable(layers[i]))


def roundtrip_reference(config, cache, fmt) -> RoundtripCache:
  """A RoundtripCache holding what the quantized contiguous `cache` holds, decoded."""
  base = kvjax.ContiguousCache.create(config, cache.lengths.shape[0], cache.max_len)
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  return RoundtripCache(**fields, stored_as=codec(fmt)).replace(
    layers=float_layers(config, cache), lengths=jnp.array(cache.lengths)
  )


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_decode_equals_float_cache_of_the_dequantized_values(fmt):
  """Ragged prefill, then STEPS decode steps. Over the quantized cache the logits equal (to 1e-5,
  float rounding) those over a float32 cache holding its dequantized values whose writes store
  what the codec reads back, and both caches end up holding the same values. Within
  FLOAT_TOLERANCE of the float cache."""
  model, params = model_params()
  seqs, prompts = sequences()
  logits, cache = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32, cache_config=contiguous(fmt))
  assert cache.codec == codec(fmt) and cache.route == ("contiguous", fmt)
  float_logits, float_cache = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32)
  worst = float(np.abs(logits - float_logits)[np.arange(10)[None] < LENGTHS[:, None]].max())

  reference = roundtrip_reference(model.config, cache, fmt)
  for step in range(STEPS):
    tokens = seqs[np.arange(3), LENGTHS + step]
    got, cache = kvjax.decode_step(model, params, cache, tokens)
    want, reference = kvjax.decode_step(model, params, reference, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    exact, float_cache = kvjax.decode_step(model, params, float_cache, tokens)
    worst = max(worst, float(np.abs(got - exact).max()))
  # Layer 0's K/V depend on the tokens alone, so the two caches hold them bit for bit; deeper
  # layers' inputs differ by the float rounding of the attention above them.
  ours, theirs = cache_layers(float_layers(model.config, cache)), cache_layers(reference.layers)
  for name in ("k", "v"):
    np.testing.assert_array_equal(ours[0][name], theirs[0][name])
    np.testing.assert_allclose(ours[-1][name], theirs[-1][name], atol=1e-5, rtol=0)
  assert 0 < worst <= FLOAT_TOLERANCE[fmt], worst


@pytest.mark.parametrize("fmt", QUANTIZED + ("bfloat16",))
def test_prefill_attends_to_its_keys_as_the_cache_stores_them(fmt):
  """A prefill's last position gives the logits of the same token decoded after prefilling the
  rest, which reads the stored (quantized, or rounded to bfloat16) K/V of the earlier tokens."""
  model, params = model_params()
  _, prompts = sequences()
  logits, _ = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32, cache_config=contiguous(fmt))
  _, shorter = kvjax.prefill(model, params, prompts, LENGTHS - 1, max_len=32, cache_config=contiguous(fmt))
  last, _ = kvjax.decode_step(model, params, shorter, prompts[np.arange(3), LENGTHS - 1])
  np.testing.assert_allclose(last, logits[np.arange(3), LENGTHS - 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_paged_matches_contiguous(fmt):
  """Ragged prefill and decode steps through scattered pages give the contiguous cache's logits;
  copy_pages copies the scale pools with the values."""
  model, params = model_params()
  seqs, prompts = sequences()
  table = np.random.default_rng(0).permutation(np.arange(1, 30))[:24].reshape(3, 8).astype(np.int32)
  cache = kvjax.PagedCache.create(model.config, 30, 4, 3, 8, paged(fmt)).with_rows(table, np.zeros(3, np.int32))
  assert cache.route == ("paged", fmt)
  want, reference = kvjax.prefill(model, params, prompts, LENGTHS, max_len=32, cache_config=contiguous(fmt))
  got, cache = kvjax.extend(model, params, cache, prompts, LENGTHS)
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(got[row, :n], want[row, :n], atol=1e-5, rtol=0)
  for step in range(3):
    tokens = seqs[np.arange(3), LENGTHS + step]
    want, reference = kvjax.decode_step(model, params, reference, tokens)
    got, cache = kvjax.decode_step(model, params, cache, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  spare = int(np.setdiff1d(np.arange(1, 30), table)[0])
  layers = jax.tree.map(np.asarray, cache_layers(cache.layers))
  copied = cache.copy_pages([table[0, 0]], [spare])  # donates the cache's pools
  for before, after in zip(layers, cache_layers(copied.layers)):
    assert sorted(after) == ["k", "k_scale", "v", "v_scale"]
    for name in after:
      np.testing.assert_array_equal(after[name][:, spare], before[name][:, table[0, 0]])


@pytest.mark.parametrize("window", [(), (4, 0)], ids=["global", "windowed"])
def test_engine_and_generate_agree_on_a_quantized_cache(window):
  """The engine (paged, continuous batching) gives generate's greedy tokens (the contiguous
  cache, a ring in a windowed layer) with an int8 cache, with and without a sliding-window layer
  whose window the rows pass."""
  model, params = model_params()
  model = kvjax.Transformer(model.config.replace(window=window, sink_tokens=1 if window else 0))
  _, prompts = sequences()
  engine = kvjax.Engine(model, params, kvjax.EngineConfig(num_slots=2, num_pages=24, max_len=32, cache=paged("int8")))
  assert engine.cache.route == ("paged", "int8")
  for row in range(3):
    engine.submit(prompts[row, : LENGTHS[row]], 6)
  outputs = engine.run()
  want = kvjax.generate(model, params, prompts, LENGTHS, 6, cache_config=contiguous("int8"))
  for row in range(3):
    np.testing.assert_array_equal(outputs[row], want[row])


@pytest.mark.parametrize("fmt", NAMES)
def test_byte_counts_are_exact(fmt):
  """nbytes of every layout == bytes per token x positions, where the bytes per token count
  values and scales by hand here; the sizes kvjax.cache.kinds gives from the configs agree."""
  config = kvjax.ModelConfig(
    vocab_size=64, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_len=32
  )
  per_head = {
    "float32": 256,
    "bfloat16": 128,
    "float16": 128,
    "int8": 64 + 4,
    "float8_e4m3fn": 64 + 4,
    "int4": 32 + 2 * 4 * 2,
  }[fmt]
  per_token = 2 * 2 * 2 * per_head  # layers x (k, v) x kv heads
  assert kinds.bytes_per_token(config, contiguous(fmt)) == per_token
  cache = kvjax.ContiguousCache.create(config, 3, 20, contiguous(fmt))
  assert cache.nbytes == 3 * 20 * per_token
  assert kinds.cache_bytes(config, contiguous(fmt), 3, 20) == cache.nbytes + 4 * 3
  pool = kvjax.PagedCache.create(config, 9, 4, 2, 5, paged(fmt))
  assert pool.nbytes == 9 * 4 * per_token
  assert kvjax.PagedCache.pool_bytes(config, paged(fmt), 9, 4, 2, 5) == pool.nbytes + 4 * 2 * 6
  rows = kvjax.PagedCache.rows(config, 3, 20, paged(fmt))  # 5 pages per row and the null page
  assert rows.nbytes == (1 + 3 * 5) * 4 * per_token
  assert kinds.cache_bytes(config, paged(fmt), 3, 20) == rows.nbytes + 4 * 3 * 6
  assert (
    kinds.sequence_bytes(config, contiguous(fmt), 20) == kinds.sequence_bytes(config, paged(fmt), 20) == 20 * per_token
  )
  for made in (cache, pool, rows):
    made.check_model(config)
