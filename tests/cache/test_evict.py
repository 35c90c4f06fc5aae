"""The evicting layout and its presses (kvjax.cache.layouts.evict, kvjax.cache.presses): ratio 0 is the
contiguous cache; each press keeps what a NumPy reading of its definition keeps; decoding through
an evicted cache is the full forward pass masked to the tokens each layer and head holds."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, tiered, tiny_config
from oracles import KeptForward, forward, held, masks_of

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.evict import EvictedCache, slots_for
from kvjax.cache.selection import kept
from kvjax.cache.presses import PRESSES, TOVA, KNorm, Random, SnapKV, StreamingLLM
from kvjax.decoding import decode
from kvjax.model.attention import Span

RNG = np.random.default_rng(0)
TOKENS = RNG.integers(0, 64, (2, 24)).astype(np.int32)
LENGTHS = np.array([24, 17], np.int32)
SETTINGS = dict(window=4, sinks=2)  # SnapKV's window and StreamingLLM's sinks; the other presses take neither


def evicting(name: str, **fields) -> CacheConfig:
  """A cache evicting by the press called `name`, with SETTINGS where it has them, and `fields`."""
  own = {f.name for f in dataclasses.fields(PRESSES[name])}
  return CacheConfig(press=PRESSES[name](**{k: v for k, v in SETTINGS.items() if k in own}, **fields))


@pytest.fixture(scope="module")
def gqa():
  return init_params(tiny_config(2))


@pytest.mark.parametrize("press", tiered(list(PRESSES), ("snapkv", "kvzip", "streaming_llm")))
def test_ratio_zero_is_the_contiguous_cache(gqa, press):
  model, params = gqa
  want, full = decode.prefill(model, params, TOKENS, LENGTHS, 32)
  got, cache = decode.prefill(model, params, TOKENS, LENGTHS, 32, cache_config=evicting(press))
  assert isinstance(cache, EvictedCache) and cache.slots == 32
  np.testing.assert_allclose(got, want, atol=1e-5)
  for token in ([1, 2], [3, 4]):
    want, full = decode.decode_step(model, params, full, np.array(token))
    got, cache = decode.decode_step(model, params, cache, np.array(token))
    np.testing.assert_allclose(got, want, atol=1e-5)
  greedy = decode.generate(model, params, TOKENS, LENGTHS, 6)
  pressed = decode.generate(model, params, TOKENS, LENGTHS, 6, cache_config=evicting(press))
  np.testing.assert_array_equal(pressed, greedy)


# NumPy readings of the presses' definitions, one row and all kv heads at a time -> [K, n] float64.


def np_weights(q, k, columns):
  """Causal softmax weights of queries q [n, N, H] at `columns` over k [K, n, H] -> [K, G, W, n]."""
  n, heads, h = q.shape
  kv = k.shape[0]
  qg = q[columns].reshape(len(columns), kv, heads // kv, h).transpose(1, 2, 0, 3)  # [K, G, W, H]
  s = qg @ k[:, None].transpose(0, 1, 3, 2) / np.sqrt(h)  # [K, G, W, n]
  s = np.where(np.arange(n)[None, :] <= np.asarray(columns)[:, None], s, -np.inf)
  s = np.exp(s - s.max(-1, keepdims=True))
  return s / s.sum(-1, keepdims=True)


def np_scores(name, q, k, settings):
  n = q.shape[0]
  kv = k.shape[0]
  if name == "knorm":
    return -np.linalg.norm(k, axis=-1)
  if name == "streaming_llm":
    pos = np.arange(n, dtype=np.float64)
    return np.broadcast_to(np.where(pos < settings["sinks"], np.inf, pos), (kv, n))
  if name == "tova":
    w = np_weights(q, k, [n - 1])[..., 0, :].mean(axis=(0, 1))  # every query head
    w[-1] = np.inf
    return np.broadcast_to(w, (kv, n))
  if name == "observed":
    w = np_weights(q, k, list(range(n))).sum(axis=2) / (n - np.arange(n))
    return w.mean(axis=1)
  if name == "snapkv":
    win, ker = settings["window"], 5
    w = np_weights(q, k, list(range(n - win, n))).mean(axis=2)[..., : n - win]  # [K, G, n - win]
    padded = np.pad(w, ((0, 0), (0, 0), (ker // 2, ker // 2)))
    pooled = np.stack([padded[..., i : i + n - win] for i in range(ker)]).sum(0) / ker
    return np.concatenate([pooled.mean(axis=1), np.full((kv, win), np.inf)], axis=1)
  raise KeyError(name)


# The presses read above; every other press has its reading in its own test file
# (tests/cache/test_press_NAME.py, test_scorers.py, test_kvzip.py).
@pytest.mark.parametrize("press", ["knorm", "streaming_llm", "tova", "observed", "snapkv"])
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_each_press_keeps_what_its_definition_keeps(press, ratio):
  """On random queries and keys (two rows of ragged lengths), the kept positions of every row and
  kv head are the int(n * (1 - ratio)) best by the NumPy reading, ties to the earlier position."""
  config = tiny_config(2, num_heads=6, head_dim=8)
  cache_config = evicting(press, compression_ratio=ratio)
  t, lengths = 24, np.array([24, 19])
  cache = EvictedCache.rows(config, 2, t, cache_config, prompt=t)
  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, t, 6, 8)).astype(np.float32)
  k = rng.normal(size=(2, 2, t, 8)).astype(np.float32)
  span = Span(jnp.broadcast_to(jnp.arange(t), (2, t)), jnp.asarray(lengths), from_empty=True)
  stored = cache.compress({"k": jnp.asarray(k), "v": jnp.asarray(k)}, jnp.asarray(q), span)
  positions = np.asarray(stored["positions"])
  for b, n in enumerate(lengths):
    scores = np_scores(press, q[b, :n].astype(np.float64), k[b, :, :n].astype(np.float64), SETTINGS)
    for head in range(2):
      order = sorted(range(n), key=lambda s: (-scores[head, s], s))
      want = sorted(order[: kept(n, ratio)])
      assert sorted(positions[b, head][positions[b, head] >= 0]) == want, (b, head)


def test_random_press_keeps_a_seeded_sample():
  config = tiny_config(2)
  cache_config = CacheConfig(press=Random(compression_ratio=0.5))
  cache = EvictedCache.rows(config, 2, 24, cache_config, prompt=24)
  new = {"k": jnp.ones((2, 2, 24, 8)), "v": jnp.ones((2, 2, 24, 8))}
  span = Span(jnp.broadcast_to(jnp.arange(24), (2, 24)), jnp.asarray([24, 10]), from_empty=True)
  first = np.asarray(cache.compress(new, jnp.ones((2, 24, 4, 8)), span)["positions"])
  again = np.asarray(cache.compress(new, jnp.zeros((2, 24, 4, 8)), span)["positions"])
  np.testing.assert_array_equal(first, again)  # the seed decides, not the inputs
  assert ((first >= 0).sum(-1) == np.array([[12, 12], [5, 5]])).all()
  assert (first[1][first[1] >= 0] < 10).all() and len(set(first[0, 0])) == len(first[0, 0])
  other = EvictedCache.rows(config, 2, 24, CacheConfig(press=Random(compression_ratio=0.5, seed=1)), prompt=24)
  assert not np.array_equal(np.asarray(other.compress(new, jnp.ones((2, 24, 4, 8)), span)["positions"]), first)


@pytest.mark.parametrize(
  "press, dtype",
  tiered(
    [(p, d) for d in (None, "int8") for p in ("snapkv", "streaming_llm", "knorm")],
    [("snapkv", None), ("streaming_llm", "int8")],
  ),
)
def test_decoding_after_eviction_is_the_forward_masked_to_the_kept_tokens(gqa, press, dtype):
  """Prefill (pressed), extend a chunk (a second turn), then decode past the budget (each step
  evicts): every call's logits equal the full forward whose queries read what the cache held."""
  model, params = gqa
  cache_config = evicting(press, compression_ratio=0.75).replace(dtype=dtype)
  tokens = RNG.integers(0, 64, (2, 40)).astype(np.int32)
  prompt, lengths = 20, np.array([20, 20], np.int32)
  cache = kinds.create(model.config, cache_config, 2, 28)  # sized for a prompt of 28: 7 slots
  logits, cache = decode.extend(model, params, cache, tokens[:, :prompt], lengths)
  assert cache.slots == 7 and ((held(cache)[0] >= 0).sum(-1) == 5).all()  # 5 kept of the prompt
  calls = [logits[:, prompt - 1]]
  history = []
  chunk = np.array([4, 4], np.int32)
  logits, cache = decode.extend(model, params, cache, tokens[:, prompt : prompt + 4], chunk)
  history.append((lengths, lengths + 4, held(cache)))
  calls.append(logits[:, -1])
  for step in range(prompt + 4, 28):
    logits, cache = decode.decode_step(model, params, cache, tokens[:, step])
    history.append((np.full(2, step), np.full(2, step + 1), held(cache)))
    calls.append(logits)
  assert ((held(cache)[0] >= 0).sum(-1) == cache.slots).all()  # full since the chunk: every later step evicted
  reference = forward(model, params, tokens[:, :28], KeptForward(masks_of(history, 28)))
  positions = [prompt - 1, prompt + 3, *range(prompt + 4, 28)]
  tolerance = 1e-4 if dtype is None else 5e-2
  for got, position in zip(calls, positions):
    np.testing.assert_allclose(got, reference[:, position], atol=tolerance, err_msg=f"position {position}")


def test_streaming_llm_evicts_the_oldest_non_sink_token(gqa):
  model, params = gqa
  cache_config = CacheConfig(press=StreamingLLM(compression_ratio=0.5, sinks=2))
  cache = kinds.create(model.config, cache_config, 1, 20)  # kept(20) = 10 slots
  _, cache = decode.extend(model, params, cache, TOKENS[:1, :12], [12])
  assert sorted(held(cache)[0][0, 0][held(cache)[0][0, 0] >= 0]) == [0, 1, 8, 9, 10, 11]
  for step in range(4):
    _, cache = decode.decode_step(model, params, cache, TOKENS[:1, 12 + step])
  assert sorted(held(cache)[1][0, 1]) == [0, 1, *range(8, 16)]
  _, cache = decode.decode_step(model, params, cache, TOKENS[:1, 16])  # full: position 8 goes
  assert sorted(held(cache)[1][0, 1]) == [0, 1, *range(9, 17)]


def test_an_int8_evicted_cache_is_the_float_one_within_int8_tolerance(gqa):
  model, params = gqa
  pressed_float = evicting("snapkv", compression_ratio=0.5)
  want, full = decode.prefill(model, params, TOKENS, LENGTHS, 30, cache_config=pressed_float)
  got, cache = decode.prefill(model, params, TOKENS, LENGTHS, 30, cache_config=pressed_float.replace(dtype="int8"))
  np.testing.assert_array_equal(held(cache)[1], held(full)[1])
  for token in ([5, 6], [7, 8]):
    want, full = decode.decode_step(model, params, full, np.array(token))
    got, cache = decode.decode_step(model, params, cache, np.array(token))
    np.testing.assert_allclose(got, want, atol=5e-2)
    assert np.abs(got - want).max() > 0  # the codec is in the path


@pytest.mark.parametrize("dtype", [None, "int8"])
def test_budgets_and_bytes_are_exact(dtype):
  config = tiny_config(2)
  cache_config = CacheConfig(press=TOVA(compression_ratio=0.75), dtype=dtype)
  cache = kinds.create(config, cache_config, 3, 40, prompt=32)
  assert cache.slots == slots_for(cache_config, 40, 32) == 40 - (32 - 8)
  assert cache.nbytes + 4 * 3 == kinds.cache_bytes(config, cache_config, 3, 40, prompt=32)
  full = kinds.cache_bytes(config, CacheConfig(dtype=dtype), 3, 40)
  per_slot = 2 * 8  # the int32 position and float32 score of each of the 2 kv heads
  kv = (full - 12) // 40 // 3 // config.num_layers
  assert cache.nbytes == 3 * config.num_layers * cache.slots * (kv + per_slot)


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda: SnapKV(compression_ratio=1.0), "SnapKV.compression_ratio must be a finite number in [0, 1), got 1.0"),
    (lambda: KNorm(compression_ratio=-0.1), "KNorm.compression_ratio must be a finite number in [0, 1), got -0.1"),
    (lambda: TOVA(compression_ratio="0.5"), "TOVA.compression_ratio must be a finite number in [0, 1), got '0.5'"),
    (lambda: SnapKV(kernel=4), "SnapKV.kernel must be odd (a centred pool), got 4"),
    (lambda: SnapKV(window=0), "SnapKV.window must be a positive integer, got 0"),
    (lambda: StreamingLLM(sinks=-1), "StreamingLLM.sinks must be a non-negative integer, got -1"),
    (lambda: Random(seed=1.5), "Random.seed must be a non-negative integer, got 1.5"),
    (lambda: KNorm(heads="ada"), "KNorm.heads must be one of ('uniform', 'adaptive'), got 'ada'"),
    (lambda: TOVA(safeguard=1.5), "TOVA.safeguard must be a finite number in [0, 1], got 1.5"),
    (lambda: CacheConfig(press="snapkv"), "CacheConfig.press must be a press (kvjax.cache.presses: streaming_llm"),
    (lambda: CacheConfig(press=SnapKV(), layout="paged"), "evicts tokens, which layout='paged' does not"),
    (lambda: CacheConfig(press=KNorm(), layout="contiguous"), "evicts tokens, which layout='contiguous' does not"),
    (lambda: CacheConfig(layout="evict"), "CacheConfig.layout='evict' needs a press, CacheConfig.press"),
  ],
)
def test_bad_presses_and_configs_are_refused_naming_the_field(make, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
    make()


def test_the_layout_is_evict_with_a_press_and_contiguous_without():
  assert CacheConfig().layout == "contiguous" and CacheConfig(press=None).layout == "contiguous"
  assert CacheConfig(press=SnapKV()).layout == "evict"
  assert CacheConfig(press=SnapKV(), layout="evict") == CacheConfig(press=SnapKV())
  assert CacheConfig(layout="paged").layout == "paged"


def test_bad_budgets_and_models_are_refused(gqa):
  model, params = gqa
  config = tiny_config(2)
  with pytest.raises(
    ValueError, match=r"budget of 8 slots \(max_len=32\) is smaller than the 16 tokens SnapKV\(.*window=16"
  ):
    kinds.create(config, CacheConfig(press=SnapKV(compression_ratio=0.75, window=16)), 1, 32, prompt=32)
  with pytest.raises(ValueError, match=r"budget of 3 slots .* smaller than the 4 tokens StreamingLLM\(.*sinks=4\)"):
    kinds.create(config, CacheConfig(press=StreamingLLM(compression_ratio=0.9)), 1, 32, prompt=32)
  with pytest.raises(ValueError, match="MLA's latent"):
    mla = tiny_config(2, kv_latent_rank=16, rope_dims=4)
    kinds.create(mla, CacheConfig(press=KNorm()), 1, 32)
  with pytest.raises(ValueError, match=r"presses the global layers \(window 0\), but the model's window=\(8,\)"):
    kinds.create(tiny_config(2, window=(8,)), CacheConfig(press=KNorm()), 1, 32)
  cache = kinds.create(config, CacheConfig(press=KNorm(compression_ratio=0.5)), 2, 64)  # 32 slots
  _, cache = decode.extend(model, params, cache, TOKENS, LENGTHS)
  with pytest.raises(ValueError, match="row 0 brings 33 tokens in one call, more than the evicting cache's 32 slots"):
    decode.extend(model, params, cache, np.zeros((2, 33), np.int32), [33, 1])


@pytest.mark.parametrize("press", ["snapkv", "knorm"])
def test_adaptive_head_budgets_keep_what_adakv_keeps(gqa, press):
  """AdaKV over a scorer: each head first keeps its int(keep * safeguard) best, then the row's
  K * keep best over all heads together (ties: the lower head, the earlier position); decoding
  reads each head's own tokens (the masked forward pass)."""
  config = tiny_config(2, num_heads=6, head_dim=8)
  cache_config = evicting(press, compression_ratio=0.75, heads="adaptive", safeguard=0.3)
  t, lengths = 24, np.array([24, 19])
  cache = EvictedCache.rows(config, 2, 48, cache_config, prompt=t)  # room for any head's share
  rng = np.random.default_rng(2)
  q = rng.normal(size=(2, t, 6, 8)).astype(np.float32)
  k = (rng.normal(size=(2, 2, t, 8)) * np.array([1.0, 3.0])[None, :, None, None]).astype(np.float32)
  span = Span(jnp.broadcast_to(jnp.arange(t), (2, t)), jnp.asarray(lengths), from_empty=True)
  positions = np.asarray(cache.compress({"k": jnp.asarray(k), "v": jnp.asarray(k)}, jnp.asarray(q), span)["positions"])
  counts = []
  for b, n in enumerate(lengths):
    scores = np_scores(press, q[b, :n].astype(np.float64), k[b, :, :n].astype(np.float64), SETTINGS)
    keep = kept(n, 0.75)
    boosted = scores.copy()
    for head in range(2):
      best = sorted(range(n), key=lambda s: (-scores[head, s], s))[: int(keep * 0.3)]
      boosted[head, best] = np.inf
    flat = sorted(range(2 * n), key=lambda i: (-boosted.flat[i], i))[: 2 * keep]
    for head in range(2):
      want = sorted(i % n for i in flat if i // n == head)
      assert sorted(positions[b, head][positions[b, head] >= 0]) == want, (b, head)
      counts.append(len(want))
  assert len(set(counts)) > 1  # the heads' budgets differ

  model, params = init_params(config)
  tokens = RNG.integers(0, 64, (2, 30)).astype(np.int32)
  cache = kinds.create(config, cache_config, 2, 30, prompt=20)
  logits, cache = decode.extend(model, params, cache, tokens[:, :20], [20, 20])
  history, calls = [], []
  for step in range(20, 30):
    logits, cache = decode.decode_step(model, params, cache, tokens[:, step])
    history.append((np.full(2, step), np.full(2, step + 1), held(cache)))
    calls.append(logits)
  reference = forward(model, params, tokens, KeptForward(masks_of(history, 30)))
  for got, position in zip(calls, range(20, 30)):
    np.testing.assert_allclose(got, reference[:, position], atol=1e-4, err_msg=f"position {position}")
