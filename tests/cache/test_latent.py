"""Oracles for multi-head latent attention and its caches: cached decode (contiguous and paged,
ragged rows) == the full forward pass; the absorbed read == the expanded read; bytes per token
equal the formula."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from conftest import init_params, tiny_config

LENGTHS = np.array([10, 4, 7])
PAGE_SIZE, MAX_PAGES, NUM_PAGES = 4, 8, 30


def mla_config(**changes) -> kvjax.ModelConfig:
  return tiny_config(2, **{"kv_latent_rank": 12, "rope_dims": 8, **changes})


@functools.cache
def model_params(**changes):
  return init_params(mla_config(**changes))


def random_tokens(shape, seed):
  return np.array(jax.random.randint(jax.random.key(seed), shape, 0, 64), np.int32)


def decode_logits(model, params, cache, seqs, steps):
  """Ragged prefill of LENGTHS, then `steps` decode steps -> the logits of every step, [steps + 1, B, V]."""
  prompts = np.where(np.arange(10)[None] < LENGTHS[:, None], seqs[:, :10], 0)
  out, cache = kvjax.extend(model, params, cache, prompts, LENGTHS, logits="last")
  logits = [np.asarray(out)]
  for step in range(steps):
    out, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), LENGTHS + step])
    logits.append(np.asarray(out))
  return np.stack(logits)


def scattered_table(seed: int) -> np.ndarray:
  pages = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))[:3 * MAX_PAGES]
  return pages.reshape(3, MAX_PAGES).astype(np.int32)


@pytest.mark.parametrize("kind", ["contiguous", "paged", "expanded"])
def test_cached_decode_matches_forward(kind):
  """Prefill of ragged prompts then 8 decode steps give the full forward pass's logits, with the
  contiguous and the paged latent cache (absorbed reads) and the contiguous one read expanded."""
  model, params = model_params()
  seqs = random_tokens((3, 20), seed=1)
  if kind == "paged":
    cache = kvjax.PagedLatentCache.create(model.config, NUM_PAGES, PAGE_SIZE, 3, MAX_PAGES)
    cache = cache.with_rows(scattered_table(0), np.zeros(3, np.int32))
  else:
    cache = kvjax.LatentCache.create(model.config, 3, 32, absorb=kind != "expanded")
  got = decode_logits(model, params, cache, seqs, steps=8)
  full = np.asarray(model.apply({"params": params}, seqs))
  want = np.stack([full[np.arange(3), LENGTHS - 1 + step] for step in range(9)])
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_absorbed_matches_expanded_on_one_cache():
  """The same cache contents read absorbed and expanded: the same attention outputs for every
  layer's queries, a read only of the latents (the function, not just the logits, agrees)."""
  model, params = model_params()
  cache = kvjax.LatentCache.create(model.config, 3, 32)
  seqs = random_tokens((3, 20), seed=2)
  _, cache = kvjax.extend(model, params, cache, seqs[:, :12], np.array([12, 5, 9]))
  attn = model.bind({"params": params}).layers[1].attn
  x = np.asarray(jax.random.normal(jax.random.key(3), (3, 1, model.config.d_model)))
  query = attn.query(x, np.asarray(cache.lengths)[:, None])
  layer = cache.layers["layers_1"]["attn"]
  mask = np.arange(32)[None, None] <= np.asarray(cache.lengths)[:, None, None]
  absorbed = query.absorbed(layer["latent"], layer["rope_key"], mask)
  expanded = query.expanded(layer["latent"], layer["rope_key"], mask)
  np.testing.assert_allclose(absorbed, expanded, atol=2e-6)
  assert np.abs(expanded).max() > 1e-2


def test_generate_and_engine_match_forward_greedy():
  """generate (contiguous latent cache) and the engine (paged latent cache) produce the greedy
  tokens of the full forward pass, token by token."""
  model, params = model_params()
  prompts, lengths = random_tokens((2, 6), seed=4), np.array([6, 3])
  tokens = np.asarray(kvjax.generate(model, params, prompts, lengths, 5))
  for row in range(2):  # teacher-forced: each generated token is the argmax after the ones before it
    context = np.concatenate([prompts[row, :lengths[row]], tokens[row]])[None]
    logits = model.apply({"params": params}, context)[0, lengths[row] - 1:-1]
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), tokens[row])
  engine = kvjax.Engine(model, params, kvjax.EngineConfig(num_slots=2, num_pages=20, page_size=4, max_len=32))
  assert isinstance(engine.cache, kvjax.PagedLatentCache)
  ids = [engine.submit(prompts[row, :lengths[row]], 5) for row in range(2)]
  results = engine.run()
  for row, i in enumerate(ids):
    np.testing.assert_array_equal(results[i], tokens[row])


def test_bytes_per_token_formula():
  """(kv_latent_rank + rope_dims) x dtype bytes per layer and token, whatever the head count; the
  caches' nbytes and the memory estimates equal it exactly."""
  from kvjax import memory
  from kvjax.interop import kv_size
  for config in (mla_config(), mla_config(num_heads=8, head_dim=8, cache_dtype="bfloat16")):
    per_token = config.num_layers * (12 + 8) * config.kv_dtype.itemsize
    assert config.kv_bytes_per_token == per_token
    contiguous = kinds.contiguous(config).create(config, 3, 16)
    assert contiguous.nbytes == 3 * 16 * per_token
    assert memory.contiguous_cache_bytes(config, 3, 16) == contiguous.nbytes + 4 * 3
    paged = kinds.paged(config).create(config, 5, 4, 3, 2)
    assert paged.nbytes == 5 * 4 * per_token
    assert memory.paged_cache_bytes(config, 5, 4, 3, 2) == paged.nbytes + 4 * 3 * 3
    dtype = "fp32" if config.kv_dtype.itemsize == 4 else "bf16"
    planned = kv_size.plan(kv_size.from_model_config("mla", config), context=16, batch=3, dtype=dtype,
                           mla=((20, 4),))
    assert planned["bytes_per_token"] == per_token and planned["cache_bytes"] == contiguous.nbytes
    assert planned["variants"][1]["bytes_per_token"] == config.num_layers * 24 * config.kv_dtype.itemsize


def test_wrong_cache_kind_is_refused():
  model, params = model_params()
  with pytest.raises(ValueError, match="needs a latent cache"):
    kvjax.decode_step(model, params, kvjax.ContiguousCache.create(model.config, 3, 16), np.zeros(3, np.int32))
  with pytest.raises(ValueError, match="kv_latent_rank=0"):
    kvjax.LatentCache.create(tiny_config(2), 3, 16)
  with pytest.raises(ValueError, match="attention='gather'"):
    kvjax.PagedLatentCache.create(model.config, 5, 4, 3, 2, attention="pallas_interpret")
