"""Oracles for multi-head latent attention's payload ({latent, rope_key}) in every layout and
codec: cached decode (contiguous and paged, ragged rows) == the full forward pass; the absorbed
read == the expanded read; a quantized latent cache == the full forward over the latents as the
codec stores them, within the codec's error bound of the float forward, and paged == contiguous
bit for bit; bytes per token equal the formula. Windowed latent caches: tests/cache/test_window.py."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cache.codec import QUANTIZED, codec
from kvjax.cache.config import CacheConfig
from kvjax.model.mla import latent_payload
from conftest import init_params, tiered, tiny_config
from oracles import StoredForward, forward

LENGTHS = np.array([10, 4, 7])
PAGE_SIZE, MAX_PAGES, NUM_PAGES = 4, 8, 30
STEPS = 6
# Largest |logit| difference between a quantized latent cache's decode and the float forward
# (logits of standard deviation ~1); measured 0.008 (int8), 0.15 (int4), 0.05 (fp8).
FLOAT_TOLERANCE = {"int8": 0.03, "int4": 0.4, "float8_e4m3fn": 0.1}


def mla_config(**changes) -> kvjax.ModelConfig:
  return tiny_config(2, **{"kv_latent_rank": 12, "rope_dims": 8, **changes})


@functools.cache
def model_params(**changes):
  return init_params(mla_config(**changes))


def random_tokens(shape, seed):
  return np.array(jax.random.randint(jax.random.key(seed), shape, 0, 64), np.int32)


def scattered_table(seed: int) -> np.ndarray:
  pages = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))[: 3 * MAX_PAGES]
  return pages.reshape(3, MAX_PAGES).astype(np.int32)


def empty_cache(config, layout: str, **choices) -> kvjax.KVCache:
  """3 rows of 32 positions: contiguous, or scattered pages of PAGE_SIZE tokens."""
  if layout == "contiguous":
    return kvjax.ContiguousCache.create(config, 3, 32, CacheConfig(**choices))
  cache = kvjax.PagedCache.create(
    config, NUM_PAGES, PAGE_SIZE, 3, MAX_PAGES, CacheConfig(layout="paged", page_size=PAGE_SIZE, **choices)
  )
  return cache.with_rows(scattered_table(0), np.zeros(3, np.int32))


def decode_logits(model, params, cache, seqs, steps):
  """Ragged prefill of LENGTHS, then `steps` decode steps -> the logits of every step, [steps + 1, B, V]."""
  prompts = np.where(np.arange(10)[None] < LENGTHS[:, None], seqs[:, :10], 0)
  out, cache = kvjax.extend(model, params, cache, prompts, LENGTHS, logits="last")
  logits = [np.asarray(out)]
  for step in range(steps):
    out, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), LENGTHS + step])
    logits.append(np.asarray(out))
  return np.stack(logits)


def at_steps(full, steps):
  """The full forward's logits [B, S, V] at the positions decode_logits reads, [steps + 1, B, V]."""
  return np.stack([full[np.arange(3), LENGTHS - 1 + step] for step in range(steps + 1)])


@pytest.mark.parametrize(
  "layout, absorb",
  [("contiguous", True), ("paged", True), ("contiguous", False)],
  ids=["contiguous", "paged", "expanded"],
)
def test_cached_decode_matches_forward(layout, absorb):
  """Prefill of ragged prompts then 8 decode steps give the full forward pass's logits, with the
  contiguous and the paged latent cache (absorbed reads) and the contiguous one read expanded."""
  model, params = model_params()
  seqs = random_tokens((3, 20), seed=1)
  cache = empty_cache(model.config, layout, absorb=absorb)
  assert cache.fields == latent_payload(model.config) and cache.absorb == absorb
  got = decode_logits(model, params, cache, seqs, steps=8)
  np.testing.assert_allclose(got, at_steps(forward_logits(None), 8), atol=2e-5)


def test_absorbed_matches_expanded_on_one_cache():
  """The same cache contents read absorbed and expanded: the same attention outputs for every
  layer's queries, a read only of the latents (the function, not just the logits, agrees)."""
  model, params = model_params()
  cache = kvjax.ContiguousCache.create(model.config, 3, 32)
  seqs = random_tokens((3, 20), seed=2)
  _, cache = kvjax.extend(model, params, cache, seqs[:, :12], np.array([12, 5, 9]))
  attn = model.bind({"params": params}).layers[1].attn
  x = np.asarray(jax.random.normal(jax.random.key(3), (3, 1, model.config.d_model)))
  query = attn.query(x, np.asarray(cache.lengths)[:, None])
  layer = cache.layers["layers_1"]["attn"]
  assert layer["latent"].shape == (3, 1, 32, 12) and layer["rope_key"].shape == (3, 1, 32, 8)  # one "head"
  mask = np.arange(32)[None, None] <= np.asarray(cache.lengths)[:, None, None]
  absorbed = query.absorbed(layer["latent"][:, 0], layer["rope_key"][:, 0], mask)
  expanded = query.expanded(layer["latent"][:, 0], layer["rope_key"][:, 0], mask)
  np.testing.assert_allclose(absorbed, expanded, atol=2e-6)
  assert np.abs(expanded).max() > 1e-2


def test_generate_and_engine_match_forward_greedy():
  """generate (contiguous latent cache) and the engine (paged latent cache) produce the greedy
  tokens of the full forward pass, token by token."""
  model, params = model_params()
  prompts, lengths = random_tokens((2, 6), seed=4), np.array([6, 3])
  tokens = np.asarray(kvjax.generate(model, params, prompts, lengths, 5))
  for row in range(2):  # teacher-forced: each generated token is the argmax after the ones before it
    context = np.zeros((1, 11), np.int32)  # one compiled shape: causality leaves the padding unread
    context[0, : lengths[row] + 5] = np.concatenate([prompts[row, : lengths[row]], tokens[row]])
    logits = forward(model, params, context)[0, lengths[row] - 1 : lengths[row] + 4]
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), tokens[row])
  engine = kvjax.Engine(
    model,
    params,
    kvjax.EngineConfig(num_slots=2, num_pages=20, max_len=32, cache=CacheConfig(layout="paged", page_size=4)),
  )
  assert isinstance(engine.cache, kvjax.PagedCache) and engine.cache.fields == latent_payload(model.config)
  ids = [engine.submit(prompts[row, : lengths[row]], 5) for row in range(2)]
  results = engine.run()
  for row, i in enumerate(ids):
    np.testing.assert_array_equal(results[i], tokens[row])


@functools.cache
def forward_logits(fmt: str | None) -> np.ndarray:
  """The full forward's logits over random_tokens((3, 20), seed=1), with the latents stored
  through `fmt` (None: as computed)."""
  model, params = model_params()
  kind = None if fmt is None else StoredForward(codec(fmt), 3)
  return forward(model, params, random_tokens((3, 20), seed=1), kind)


@pytest.mark.parametrize("fmt", tiered(list(QUANTIZED), ("int4",)))
def test_quantized_latent_cache_is_the_forward_over_its_stored_latents(fmt):
  """A ragged prefill and STEPS decode steps over an int8 / int4 / fp8 latent cache, contiguous
  and in scattered pages: the logits of the full forward whose latents pass through the codec
  (to 1e-5, float rounding: the cache reads absorbed, the forward expanded), and within the
  codec's FLOAT_TOLERANCE of the float forward, which the codec does move. Paged == contiguous
  bit for bit: the same codec, the same reads, only the addressing differs."""
  model, params = model_params()
  seqs = random_tokens((3, 20), seed=1)
  stored, exact = at_steps(forward_logits(fmt), STEPS), at_steps(forward_logits(None), STEPS)
  assert 1e-3 < np.abs(stored - exact).max() <= FLOAT_TOLERANCE[fmt]
  got = {}
  for layout in ("contiguous", "paged"):
    cache = empty_cache(model.config, layout, dtype=fmt)
    layer = cache.layers["layers_0"]["attn"]
    assert sorted(layer) == ["latent", "latent_scale", "rope_key", "rope_key_scale"]
    assert layer["latent"].dtype == codec(fmt).stored_dtype and cache.route == (layout, fmt)
    got[layout] = decode_logits(model, params, cache, seqs, STEPS)
    np.testing.assert_allclose(got[layout], stored, atol=1e-5, rtol=0, err_msg=layout)
    assert np.abs(got[layout] - exact).max() <= FLOAT_TOLERANCE[fmt]
  np.testing.assert_array_equal(got["paged"], got["contiguous"])


def test_bytes_per_token_formula():
  """(kv_latent_rank + rope_dims) values per layer and token, whatever the head count, in the
  codec's bytes, and the float32 scales of a quantized codec (one per vector; int4 a step and a
  zero point per group of int4_group_size: 12 and 8 are one group each); the caches' nbytes and
  the kinds' sizes equal it exactly."""
  per_layer = {
    "float32": (12 + 8) * 4,
    "bfloat16": (12 + 8) * 2,
    "int8": 12 + 4 + 8 + 4,
    "float8_e4m3fn": 12 + 4 + 8 + 4,
    "int4": 6 + 2 * 4 + 4 + 2 * 4,
  }
  for config in (mla_config(), mla_config(num_heads=8, head_dim=8)):
    for fmt, per_position in per_layer.items():
      per_token = config.num_layers * per_position
      contiguous, paged = CacheConfig(dtype=fmt), CacheConfig(layout="paged", page_size=4, dtype=fmt)
      assert kinds.bytes_per_token(config, contiguous) == per_token
      cache = kvjax.ContiguousCache.create(config, 3, 16, contiguous)
      assert cache.nbytes == 3 * 16 * per_token
      assert kinds.cache_bytes(config, contiguous, 3, 16) == cache.nbytes + 4 * 3
      pool = kvjax.PagedCache.create(config, 5, 4, 3, 2, paged)
      assert pool.nbytes == 5 * 4 * per_token
      assert kvjax.PagedCache.pool_bytes(config, paged, 5, 4, 3, 2) == pool.nbytes + 4 * 3 * 3
      rows = kvjax.PagedCache.rows(config, 3, 16, paged)
      assert kinds.cache_bytes(config, paged, 3, 16) == rows.nbytes + 4 * 3 * 5 == (1 + 12) * 4 * per_token + 60


def test_wrong_cache_kind_is_refused():
  model, params = model_params()
  kv_cache = kvjax.ContiguousCache.create(tiny_config(2), 3, 16)
  with pytest.raises(
    ValueError,
    match=r"it stores \['k', 'v'\] per token .* the model's attention hands it "
    r"\{'latent'",
  ):
    kvjax.decode_step(model, params, kv_cache, np.zeros(3, np.int32))
  latent_cache = kvjax.ContiguousCache.create(model.config, 3, 16)
  with pytest.raises(ValueError, match=r"it stores \['latent', 'rope_key'\] per token"):
    kvjax.decode_step(kvjax.Transformer(tiny_config(2)), params, latent_cache, np.zeros(3, np.int32))
  with pytest.raises(ValueError, match=r"it stores \['latent', 'rope_key'\] per token .*Field\(heads=1, width=12"):
    kvjax.decode_step(kvjax.Transformer(mla_config(kv_latent_rank=10)), params, latent_cache, np.zeros(3, np.int32))
