"""The query-agnostic scorers KeyDiff and Expected Attention and the pyramid's per-layer budgets
(kvjax.cache.presses): each keeps what a NumPy reading of kvpress's definition keeps (random
queries, keys and values, ragged rows, GQA and MQA), and decoding through them is the full forward
pass masked to the tokens each layer and head holds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, tiny_config
from oracles import KeptForward, forward, held, masks_of

from kvjax.cache import kinds, selection
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.evict import EvictedCache
from kvjax.cache.presses import ExpectedAttention, KeyDiff, SnapKV, make_press
from kvjax.decoding import decode
from kvjax.fields import apply_overrides
from kvjax.model.attention import Span
from kvjax.model.rope import Rope

ROPE = Rope(10000.0, 8)


def np_rotate(x, positions, theta=10000.0):
  """Rotate-half RoPE of x [n, heads, H] at positions int[n], in float64."""
  h = x.shape[-1]
  angle = positions[:, None, None] * theta ** (-np.arange(h // 2) / (h // 2))  # [n, 1, H/2]
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


def np_keydiff(k):
  """kvpress KeyDiffPress.score for k [K, n, H] -> [K, n]."""
  anchor = (k / np.linalg.norm(k, axis=-1, keepdims=True)).mean(axis=1, keepdims=True)
  return -(k * anchor).sum(-1) / (np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor, axis=-1))


def np_expected_attention(pre_q, k, v, sinks=4, future=512, theta=10000.0):
  """kvpress ExpectedAttentionPress.score for the queries before RoPE pre_q [n, N, H], k and v
  [K, n, H]: its rotation matrices R = cos I + sin P averaged over positions n .. n + future - 1."""
  n, heads, h = pre_q.shape
  kv = k.shape[0]
  stats = pre_q[sinks:].transpose(1, 0, 2)  # [N, n - sinks, H]
  mu = stats.mean(axis=1)
  centred = stats - mu[:, None]
  cov = np.einsum("nsi,nsj->nij", centred, centred) / (n - sinks)
  inv = theta ** (-np.arange(h // 2) / (h // 2))
  angle = np.arange(n, n + future)[:, None] * np.concatenate([inv, inv])[None]  # [F, H]: HF's cos / sin layout
  p = np.zeros((h, h))
  p[h // 2 :, : h // 2], p[: h // 2, h // 2 :] = np.eye(h // 2), -np.eye(h // 2)
  r = (np.cos(angle)[:, None, :] * np.eye(h) + np.sin(angle)[:, None, :] * p).mean(axis=0)
  mu, cov = mu @ r.T, r @ cov @ r.T
  keys = np.repeat(k[:, sinks:], heads // kv, axis=0)  # [N, n - sinks, H]
  s = np.einsum("nh,nth->nt", mu, keys) / np.sqrt(h) + np.einsum("nti,nij,ntj->nt", keys, cov, keys) / h / 2
  s = np.exp(s - s.max(-1, keepdims=True))
  s = (s / s.sum(-1, keepdims=True)).reshape(kv, heads // kv, -1).mean(axis=1) * np.linalg.norm(v[:, sinks:], axis=-1)
  return np.concatenate([np.full((kv, sinks), s.max() + 1), s], axis=1)


@pytest.mark.parametrize("kv_heads, heads", [(2, 6), (1, 4)])  # GQA, MQA
@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("press", ["keydiff", "expected_attention"])
def test_each_scorer_keeps_what_kvpress_definition_keeps(press, ratio, kv_heads, heads):
  config = tiny_config(kv_heads, num_heads=heads, head_dim=8)
  t, lengths = 24, np.array([24, 19])
  cache = EvictedCache.rows(config, 2, t, CacheConfig(press=make_press(press, compression_ratio=ratio)), prompt=t)
  rng = np.random.default_rng(2)
  pre_q = rng.normal(size=(2, t, heads, 8))
  q = np.stack([np_rotate(x, np.arange(t)) for x in pre_q]).astype(np.float32)
  k, v = (rng.normal(size=(2, kv_heads, t, 8)).astype(np.float32) for _ in range(2))
  span = Span(jnp.broadcast_to(jnp.arange(t), (2, t)), jnp.asarray(lengths), from_empty=True)
  stored = cache.compress({"k": jnp.asarray(k), "v": jnp.asarray(v)}, jnp.asarray(q), span, ROPE)
  positions = np.asarray(stored["positions"])
  for b, n in enumerate(lengths):
    kb, vb = k[b, :, :n].astype(np.float64), v[b, :, :n].astype(np.float64)
    scores = np_keydiff(kb) if press == "keydiff" else np_expected_attention(pre_q[b, :n], kb, vb)
    for head in range(kv_heads):
      order = sorted(range(n), key=lambda s: (-scores[head, s], s))
      want = sorted(order[: int(n * (1 - ratio))])
      assert sorted(positions[b, head][positions[b, head] >= 0]) == want, (b, head)


def test_pyramid_budgets_are_kvpress_layer_budgets():
  """PyramidKV's budgets by hand (window 4, beta 20, 2 layers): n = 24 at ratio 0.5 shares
  12 a layer; the top would be 2 * 12 - 12 / 20 = 23.4 > n - window, so it is 20 and the bottom
  2 * 12 - 20 = 4. A prompt too short for the pyramid keeps round(n * (1 - ratio)), at least 1."""
  press = SnapKV(compression_ratio=0.5, window=4, layers="pyramid")
  assert [int(selection.layer_kept(press, 24, layer, 2)) for layer in (0, 1)] == [20, 4]
  assert [int(selection.layer_kept(press, 19, layer, 2)) for layer in (0, 1)] == [15, 4]
  assert selection.layer_kept(press, np.array([6, 1]), 0, 2).tolist() == [3, 1]  # 6: the bottom 2.85 < window 4
  # 100 tokens over 5 layers at ratio 0.75: share 25, bottom 25 / 20 = 1.25 < window, so uniform 25
  assert selection.layer_kept(SnapKV(compression_ratio=0.75, window=4, layers="pyramid"), 100, 3, 5) == 25
  # window 0 (KeyDiff): 100 tokens, 3 layers, ratio 0.5: bottom 2.5, top 97.5 -> 97.5, 50, 2.5 rounded evenly
  keydiff = KeyDiff(compression_ratio=0.5, layers="pyramid")
  assert [int(selection.layer_kept(keydiff, 100, layer, 3)) for layer in range(3)] == [98, 50, 2]
  assert selection.layer_kept(SnapKV(window=4, layers="pyramid"), 24, 1, 2) == 24  # ratio 0 keeps all


def test_pyramid_composes_with_any_press_from_the_command_line():
  config = apply_overrides(CacheConfig(), ["press=snapkv", "press.layers=pyramid", "press.beta=10"])
  assert config.press == SnapKV(layers="pyramid", beta=10)
  assert apply_overrides(config, ["press=keydiff", "press.layers=pyramid"]).press == KeyDiff(layers="pyramid")
  with pytest.raises(ValueError, match="SnapKV.layers must be one of \\('uniform', 'pyramid'\\), got 'pyramids'"):
    apply_overrides(config, ["press.layers='pyramids'"])
  with pytest.raises(ValueError, match="SnapKV.beta must be a positive int"):
    apply_overrides(config, ["press.beta=0"])
  with pytest.raises(ValueError, match="ExpectedAttention.n_future_positions must be a positive int"):
    ExpectedAttention(n_future_positions=0)
  with pytest.raises(ValueError, match="ExpectedAttention.use_vnorm must be True or False, got 1"):
    ExpectedAttention(use_vnorm=1)
  with pytest.raises(ValueError, match="ExpectedAttention.epsilon must be a finite number"):
    ExpectedAttention(epsilon=-1.0)


@pytest.fixture(scope="module")
def gqa():
  return init_params(tiny_config(2))


@pytest.mark.parametrize(
  "press",
  [
    ExpectedAttention(compression_ratio=0.5, n_sink=2, n_future_positions=16),
    SnapKV(compression_ratio=0.5, window=4, layers="pyramid"),
    KeyDiff(compression_ratio=0.5, layers="pyramid", heads="adaptive"),
  ],
)
def test_decoding_through_a_scorer_is_the_forward_masked_to_the_kept_tokens(gqa, press):
  """Prefill 20 tokens (pressed; the pyramid keeps 16 in layer 0 and 4 in layer 1), then decode 3 tokens:
  every call's logits equal the full forward whose queries read what each layer held."""
  model, params = gqa
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 64, (2, 23)).astype(np.int32)
  prompt, lengths = 20, np.array([20, 20], np.int32)
  cache = kinds.create(model.config, CacheConfig(press=press), 2, 23, prompt=prompt)
  logits, cache = decode.extend(model, params, cache, tokens[:, :prompt], lengths)
  counts = [(h >= 0).sum(-1) for h in held(cache)]
  budgets = [int(selection.layer_kept(press, prompt, layer, 2)) for layer in (0, 1)]
  if press.heads == "uniform":
    assert [c.max() for c in counts] == [c.min() for c in counts] == budgets
  else:
    assert [c.sum(-1).tolist() for c in counts] == [[2 * b, 2 * b] for b in budgets]
  if press.layers == "pyramid":
    assert budgets == [16, 4] if press.name == "snapkv" else budgets[0] > budgets[1]
  calls, history = [logits[:, prompt - 1]], []
  for step in range(prompt, 23):
    logits, cache = decode.decode_step(model, params, cache, tokens[:, step])
    history.append((np.full(2, step), np.full(2, step + 1), held(cache)))
    calls.append(logits)
  reference = forward(model, params, tokens, KeptForward(masks_of(history, 23)))
  for got, position in zip(calls, range(prompt - 1, 23)):
    np.testing.assert_allclose(got, reference[:, position], atol=1e-4, err_msg=f"position {position}")


def test_a_pyramid_stores_its_first_layers_budget_and_counts_it():
  """Every layer's storage is the first layer's slots (20 of a 24-token prompt kept, 16 later
  positions): the bytes counted are the bytes held."""
  config, cache_config = tiny_config(2), CacheConfig(press=SnapKV(compression_ratio=0.5, window=4, layers="pyramid"))
  cache = kinds.create(config, cache_config, 3, 40, prompt=24)
  assert cache.slots == 40 - 24 + 20 and cache.num_layers == 2
  assert cache.nbytes + 4 * 3 == kinds.cache_bytes(config, cache_config, 3, 40, prompt=24)
