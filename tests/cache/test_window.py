"""Oracles for sliding-window layers with sink tokens: the mask against its definition, cached
decode (contiguous ring, paged) == the full forward under the same mask past the ring's wrap,
for K/V (plain and Gemma 3 shaped) and MLA's latents, float and int8; CacheConfig.window on a global model == the model of
that window; constant cache bytes, and an all-window model generating 4x its max_len."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import init_params, tiered, tiny_config
from kvjax.cache import kinds
from kvjax.cache.codec import codec
from kvjax.cache.config import CacheConfig
from kvjax.fields import apply_overrides
from kvjax.model.keys import Window, visible
from oracles import StoredForward, forward

PAGE_SIZE, MAX_PAGES, NUM_PAGES = 4, 10, 34
# Layer 0 windowed (6 wide, 2 sinks: a ring of 8 slots), layer 1 global.
LOCAL_GLOBAL = dict(window=(6, 0), sink_tokens=2, max_len=40)
# ModelConfig changes; "gemma" is a Gemma 3 shaped K/V model (GeGLU, q/k norms, post-norms, scaled
# embeddings, its own RoPE base on the windowed layer).
GEMMA = dict(
  activation="geglu", qk_norm=True, post_norms=True, scale_embeddings=True, rope_local_theta=100.0, tie_embeddings=True
)
PAYLOADS = {"kv": {}, "latent": dict(kv_latent_rank=12, rope_dims=8), "gemma": GEMMA}


def random_tokens(shape, seed):
  return np.asarray(jax.random.randint(jax.random.key(seed), shape, 0, 64), np.int32)


def test_mask_is_the_definition():
  rng = np.random.default_rng(0)
  q = rng.integers(0, 30, (2, 5))
  keys = rng.integers(-1, 30, (2, 7))
  for size, sinks in ((0, 0), (1, 0), (4, 0), (4, 3), (30, 1)):
    got = np.asarray(visible(jnp.asarray(q), jnp.asarray(keys), Window(size, sinks)))
    for b, i, j in itertools.product(range(2), range(5), range(7)):
      t, s = q[b, i], keys[b, j]
      want = 0 <= s <= t and (size == 0 or t - s < size or s < sinks)
      assert got[b, i, j] == want, (size, sinks, t, s)


def test_windowed_forward_reads_only_the_window():
  """One RoPE layer, no sinks: position t's logits are those of the window alone, run through
  the global model (RoPE scores depend only on the distance between positions)."""
  windowed, params = init_params(tiny_config(2, num_layers=1, window=(5,)))
  plain = kvjax.Transformer(windowed.config.replace(window=()))
  tokens = random_tokens((2, 16), seed=3)
  full = np.asarray(jax.jit(windowed.apply)({"params": params}, tokens))
  run_plain = jax.jit(plain.apply)
  for t in (4, 9, 15):
    alone = np.asarray(run_plain({"params": params}, tokens[:, t - 4 : t + 1]))
    np.testing.assert_allclose(full[:, t], alone[:, -1], atol=1e-4)
  np.testing.assert_allclose(full[:, :5], np.asarray(run_plain({"params": params}, tokens[:, :5])), atol=1e-5)
  assert not np.allclose(full[:, 15], np.asarray(run_plain({"params": params}, tokens))[:, 15], atol=1e-3)


def empty_cache(layout, config, cache_config=CacheConfig(), batch=3):
  if layout == "contiguous":
    return kvjax.ContiguousCache.create(config, batch, MAX_PAGES * PAGE_SIZE, cache_config)
  table = np.random.default_rng(0).permutation(np.arange(1, NUM_PAGES))[: batch * MAX_PAGES]
  cache = kvjax.PagedCache.create(
    config, NUM_PAGES, PAGE_SIZE, batch, MAX_PAGES, cache_config.replace(layout="paged", page_size=PAGE_SIZE)
  )
  return cache.with_rows(table.reshape(batch, MAX_PAGES), np.zeros(batch, np.int32))


def chunk(seqs, held, lengths, width=11):
  """Each row's next lengths[b] tokens after held[b], right-padded to `width` (one compiled
  shape for every chunk)."""
  out = np.zeros((len(held), width), np.int32)
  for row, (start, n) in enumerate(zip(held, lengths)):
    out[row, :n] = seqs[row, start : start + n]
  return out


def decode_against_forward(model, params, kind, seqs, full=None, atol=1e-5, cache_config=CacheConfig()):
  """Ragged prefill, chunked extends (one longer than the ring), then decode steps well past the
  ring's wrap, through a `kind` ("contiguous" or "paged") cache of `cache_config`; every logit is
  checked against the full forward (or `full`, its logits given) to `atol`. Returns the decode
  logits."""
  full = forward(model, params, seqs) if full is None else full
  cache, held = empty_cache(kind, model.config, cache_config), np.zeros(3, int)
  for lengths in (np.array([3, 7, 1]), np.array([11, 0, 4]), np.array([1, 2, 9])):
    logits, cache = kvjax.extend(model, params, cache, chunk(seqs, held, lengths), lengths)
    for row in range(3):
      np.testing.assert_allclose(
        logits[row, : lengths[row]],
        full[row, held[row] : held[row] + lengths[row]],
        atol=atol,
        err_msg=f"{kind} extend row {row}",
      )
    held = held + lengths
  steps = []
  for _ in range(12):
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), held])
    np.testing.assert_allclose(logits, full[np.arange(3), held], atol=atol, err_msg=f"{kind} decode")
    steps.append(np.asarray(logits))
    held = held + 1
  return np.stack(steps)


@pytest.mark.parametrize("payload", tiered(list(PAYLOADS), ("kv", "gemma")))
def test_cached_decode_matches_windowed_forward_and_paged_matches_contiguous(payload):
  """K/V and MLA's latents alike: the contiguous cache keeps the windowed layer in a ring of
  window + sinks slots (a chunk of 11 tokens crosses it), and both layouts decode past its wrap
  to the windowed model's full forward."""
  model, params = init_params(tiny_config(2, **LOCAL_GLOBAL, **PAYLOADS[payload]))
  ring = kvjax.ContiguousCache.create(model.config, 3, 40).layers
  name = "latent" if payload == "latent" else "v"
  assert ring["layers_0"]["attn"][name].shape[2] == 8 and ring["layers_1"]["attn"][name].shape[2] == 40
  seqs = random_tokens((3, 40), seed=1)  # rows reach 27, 21, 26 positions: the 8-slot ring wraps
  contiguous = decode_against_forward(model, params, "contiguous", seqs)
  paged = decode_against_forward(model, params, "paged", seqs)
  np.testing.assert_allclose(paged, contiguous, atol=1e-5)


# |logit| gap between an int8 cache's decode and the dequantized forward: the payload of layers
# past the first comes from inputs that differ by float rounding (and the CPU kernel applies the
# scales to scores; MLA's cache reads absorbed where the forward reads expanded), so a value may
# rarely round to the neighbouring int8 step; measured 1e-6, where the quantization itself moves
# the logits by 0.009.
INT8_TOLERANCE = 1e-4


@pytest.mark.parametrize("payload", tiered(list(PAYLOADS), ("kv",)))
def test_int8_ring_decode_matches_the_dequantized_windowed_forward(payload):
  """An int8 cache with a windowed layer (the contiguous ring, scales in the same slots; the
  paged pools), of K/V or of MLA's latents, decodes past the ring's wrap to the full forward's
  logits under the window mask over the dequantized payload, within INT8_TOLERANCE."""
  model, params = init_params(tiny_config(2, **LOCAL_GLOBAL, **PAYLOADS[payload]))
  int8 = CacheConfig(dtype="int8")
  ring = kvjax.ContiguousCache.create(model.config, 3, 40, int8).layers["layers_0"]["attn"]
  assert {x.shape[2 if name != "k" else 3] for name, x in ring.items()} == {8}
  seqs = random_tokens((3, 40), seed=1)
  full = forward(model, params, seqs, StoredForward(codec("int8"), 3))
  assert np.abs(full - forward(model, params, seqs)).max() > 10 * INT8_TOLERANCE
  contiguous = decode_against_forward(model, params, "contiguous", seqs, full, INT8_TOLERANCE, int8)
  paged = decode_against_forward(model, params, "paged", seqs, full, INT8_TOLERANCE, int8)
  np.testing.assert_allclose(paged, contiguous, atol=INT8_TOLERANCE)


def test_cache_window_is_the_model_with_that_window():
  """CacheConfig.window and sink_tokens on a model trained with full attention decode it as the
  model of that window (StreamingLLM): both layouts give that model's full forward, which the
  global model's differs from; the contiguous cache keeps the ring of that window. A cache made
  without them decodes by the model's own windows: a paged one made for the global model gives
  the windowed model's forward."""
  windowed, params = init_params(tiny_config(2, **LOCAL_GLOBAL))
  plain = kvjax.Transformer(windowed.config.replace(window=(), sink_tokens=0))
  override = CacheConfig(window=LOCAL_GLOBAL["window"], sink_tokens=LOCAL_GLOBAL["sink_tokens"])
  seqs = random_tokens((3, 40), seed=2)
  full = forward(windowed, params, seqs)
  assert not np.allclose(full, forward(plain, params, seqs), atol=1e-2)
  ring = kvjax.ContiguousCache.create(plain.config, 3, 40, override)
  assert ring.layers["layers_0"]["attn"]["v"].shape[2] == 8 and ring.model_config(plain.config) == windowed.config
  for layout in ("contiguous", "paged"):
    decode_against_forward(plain, params, layout, seqs, full, cache_config=override)
  paged = empty_cache("paged", plain.config)
  logits, _ = kvjax.extend(windowed, params, paged, seqs[:, :20], np.array([20, 13, 17]))
  np.testing.assert_allclose(logits[0], full[0, :20], atol=1e-5)


def test_sinks_are_kept():
  """The same weights without sinks give other logits once the window has passed them, and the
  ring (which overwrites everything else) still gives the sinks' logits."""
  model, params = init_params(tiny_config(2, num_layers=1, window=(4,), sink_tokens=2, max_len=16))
  no_sinks = kvjax.Transformer(model.config.replace(sink_tokens=0))
  seqs = random_tokens((1, 14), seed=4)
  full = np.asarray(model.apply({"params": params}, seqs))
  dropped = np.asarray(no_sinks.apply({"params": params}, seqs))
  np.testing.assert_allclose(full[:, :4], dropped[:, :4], atol=1e-6)  # the sinks are still in the window
  assert not np.allclose(full[:, 8:], dropped[:, 8:], atol=1e-3)
  logits, cache = kvjax.prefill(model, params, seqs[:, :9], np.array([9]), 16)
  np.testing.assert_allclose(logits[0], full[0, :9], atol=1e-5)
  for t in range(9, 14):
    logits, cache = kvjax.decode_step(model, params, cache, seqs[:, t])
    np.testing.assert_allclose(logits, full[:, t], atol=1e-5)
  assert cache.layers["layers_0"]["attn"]["v"].shape[2] == 6


def test_cache_bytes_stop_growing_at_the_window():
  config = tiny_config(2, **LOCAL_GLOBAL)
  per_position = 2 * config.num_kv_heads * config.head_dim * 4  # K and V of one layer, float32
  for length in (4, 8, 20, 40):
    for fmt, per_head in (("float32", 8 * 4), ("int8", 8 + 4), ("int4", 4 + 2 * 4), ("float8_e4m3fn", 8 + 4)):
      # head_dim 8: values + scales
      cache_config = CacheConfig(dtype=fmt)
      cache = kvjax.ContiguousCache.create(config, 3, length, cache_config)
      assert cache.nbytes == 3 * 2 * config.num_kv_heads * per_head * (min(length, 8) + length)
      assert cache.nbytes == 3 * kinds.sequence_bytes(config, cache_config, length)
      assert kinds.cache_bytes(config, cache_config, 3, length) == cache.nbytes + 4 * 3
    assert kvjax.ContiguousCache.create(config, 3, length).nbytes == 3 * per_position * (min(length, 8) + length)
  every = tiny_config(2, window=(6,), sink_tokens=2, max_len=40)
  sizes = {kvjax.ContiguousCache.create(every, 3, n).nbytes for n in (8, 40, 160, 10_000)}
  assert sizes == {3 * 2 * per_position * 8}
  # The same rings for a global model given the window by its CacheConfig.
  override = CacheConfig(window=(6,), sink_tokens=2)
  assert kvjax.ContiguousCache.create(tiny_config(2, max_len=40), 3, 40, override).nbytes == 3 * 2 * per_position * 8
  assert kinds.cache_bytes(tiny_config(2, max_len=40), override, 3, 10_000) == 3 * 2 * per_position * 8 + 4 * 3


def greedy_reference(model, params, prompt, total):
  """Greedy tokens from the full forward pass, recomputed over the whole sequence every step
  (one compiled shape: the sequence is padded to `total`, which causality leaves unread)."""
  forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
  seq = np.zeros((1, total), np.int32)
  seq[0, : len(prompt)] = prompt
  for t in range(len(prompt), total + 1):
    token = int(np.argmax(np.asarray(forward(seq))[0, t - 1]))
    if t == total:
      return seq[0, len(prompt) :], token
    seq[0, t] = token


def test_all_window_model_generates_four_times_max_len_in_constant_memory():
  """And so does the global model decoded with that window by its CacheConfig."""
  model, params = init_params(tiny_config(2, window=(5,), sink_tokens=2, max_len=16))
  prompt = random_tokens((1, 6), seed=5)[0]
  total = 4 * model.config.max_len
  new = total - len(prompt) + 1  # the last token generated would sit at position 4 * max_len
  tokens = np.asarray(kvjax.generate(model, params, prompt[None], np.array([6]), new))[0]
  fed, last = greedy_reference(model, params, prompt, total)
  np.testing.assert_array_equal(tokens, np.append(fed, last))
  plain = kvjax.Transformer(model.config.replace(window=(), sink_tokens=0))
  override = CacheConfig(window=(5,), sink_tokens=2)
  np.testing.assert_array_equal(
    kvjax.generate(plain, params, prompt[None], np.array([6]), new, cache_config=override)[0], tokens
  )
  # The cache of 4x max_len positions is the cache of max_len: 7 slots per layer.
  assert (
    kvjax.ContiguousCache.create(model.config, 1, total).nbytes
    == kvjax.ContiguousCache.create(model.config, 1, 16).nbytes
    == kinds.sequence_bytes(model.config, CacheConfig(), 7)
    == 2 * 7 * 2 * 2 * 8 * 4
  )
  # decode_step goes past max_len on a cache made for it, and its arrays keep their shapes.
  logits, cache = kvjax.prefill(model, params, prompt[None], np.array([6]), total, logits="last")
  shapes = jax.tree.map(np.shape, cache.layers)
  for token in fed[:20]:
    logits, cache = kvjax.decode_step(model, params, cache, np.array([token]))
  assert int(cache.lengths[0]) == 26 > model.config.max_len
  assert jax.tree.map(np.shape, cache.layers) == shapes


def test_bad_windows_are_refused():
  for changes, message in (
    (dict(window=(65,)), r"window\[0\]=65 is larger than max_len=64"),
    (dict(window=(4, -1)), r"window\[1\] must be a non-negative integer"),
    (dict(window=(4, True)), r"window\[1\] must be a non-negative integer"),
    (dict(window=4), "must be a tuple of per-layer window widths"),
    (dict(sink_tokens=2), r"sink_tokens=2 needs a windowed layer, but window=\(\)"),
    (dict(window=(0, 0), sink_tokens=1), "sink_tokens=1 needs a windowed layer"),
    (dict(window=(8,), sink_tokens=-1), "sink_tokens must be a non-negative integer"),
    (dict(window=(60,), sink_tokens=5), r"sink_tokens=5 \+ window 60 is more than max_len=64"),
  ):
    with pytest.raises(ValueError, match=message):
      tiny_config(2, **changes)
  run = apply_overrides(tiny_config(2), ["window=(8, 0)", "sink_tokens=4"])
  assert (run.window, run.layer_window(3), run.layer_window(2), run.sink_tokens) == ((8, 0), 0, 8, 4)

  local_global, params = init_params(tiny_config(2, window=(8, 0)))
  with pytest.raises(ValueError, match="only a model whose every layer is windowed"):
    kvjax.ContiguousCache.create(local_global.config, 1, 65)
  learned, learned_params = init_params(tiny_config(2, window=(8,), positions="learned"))
  with pytest.raises(ValueError, match="learned positions end at max_len even when every layer is windowed"):
    kvjax.generate(learned, learned_params, np.ones((1, 4), np.int32), np.array([4]), 62)
  with pytest.raises(ValueError, match="max_len=80 positions, more than ModelConfig.max_len=64; learned"):
    kvjax.ContiguousCache.create(learned.config, 1, 80)
  # A contiguous cache made for the global model has no ring for the windowed model's layer 0.
  with pytest.raises(ValueError, match=r"layer 0 k is .* and window=\(8, 0\) in a float32 cache needs"):
    kvjax.decode_step(local_global, params, kvjax.ContiguousCache.create(tiny_config(2), 1, 64), np.array([1]))
  with pytest.raises(ValueError, match=r"this one has windowed layers \(window=\(8, 0\)\)"):
    kvjax.ContiguousCache.create(local_global.config, 1, 32).resized(64)
  with pytest.raises(
    ValueError,
    match=r"CacheConfig.window=\(65,\), sink_tokens=None do not fit the model: "
    r"ModelConfig.window\[0\]=65 is larger than max_len=64",
  ):
    kvjax.ContiguousCache.create(tiny_config(2), 1, 64, CacheConfig(window=(65,)))
  with pytest.raises(ValueError, match=r"window\[1\] must be a non-negative integer"):
    CacheConfig(window=(4, -1))
  with pytest.raises(ValueError, match=r"do not fit the model: ModelConfig.sink_tokens=2 needs a windowed layer"):
    kvjax.prefill(
      local_global,
      params,
      np.ones((1, 4), np.int32),
      np.array([4]),
      8,
      cache_config=CacheConfig(window=(0,), sink_tokens=2),
    )
