"""Pressing an evicting cache to a budget as it decodes (kvjax.cache.selection, the presses'
decode_budget / decode_interval / prefill_chunk): a budget at or above the length is the full
cache; every call under a budget is the full forward pass masked to what its queries read (the
budget and the call's own tokens), through chunked prefill and decode-time eviction; TOVA's and
H2O's decode-time rules drop the victims a NumPy reading of them chooses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, tiered, tiny_config
from oracles import KeptForward, forward, held, masks_of

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.evict import EvictedCache
from kvjax.cache.presses import PRESSES, TOVA, KNorm, ObservedAttention, SnapKV, StreamingLLM
from kvjax.decoding import decode
from kvjax.model.attention import KVQuery, Span
from kvjax.model.backend import XLA

RNG = np.random.default_rng(3)
TOKENS = RNG.integers(0, 64, (2, 40)).astype(np.int32)
LENGTHS = np.array([20, 15], np.int32)


@pytest.fixture(scope="module")
def gqa():
  return init_params(tiny_config(2))


def budgeted(name: str, **fields) -> CacheConfig:
  extra = {"sinks": 2} if name == "streaming_llm" else {}
  return CacheConfig(press=PRESSES[name](**extra, **fields))


@pytest.mark.parametrize("press", ["tova"])
def test_a_budget_at_or_above_the_length_is_the_full_cache(gqa, press):
  model, params = gqa
  cache_config = budgeted(press, decode_budget=40, decode_interval=2, prefill_chunk=8)
  want, _ = decode.prefill(model, params, TOKENS[:, :20], LENGTHS, 32)
  got, cache = decode.prefill(model, params, TOKENS[:, :20], LENGTHS, 32, cache_config=cache_config)
  for b, n in enumerate(LENGTHS):  # the real columns (padding columns read what they may)
    np.testing.assert_allclose(got[b, :n], want[b, :n], atol=1e-5)
  greedy = decode.generate(model, params, TOKENS[:, :20], LENGTHS, 8)
  pressed = decode.generate(model, params, TOKENS[:, :20], LENGTHS, 8, cache_config=cache_config)
  np.testing.assert_array_equal(pressed, greedy)


def read_by(before: list, start: np.ndarray, end: np.ndarray) -> list:
  """Per layer, the positions a call's queries read: what the cache held before it and the call's
  own positions [start, end) (int[B, K, S + width], -1 padding)."""
  width = int((end - start).max())
  own = start[:, None] + np.arange(width)[None, :]
  own = np.where(own < end[:, None], own, -1)  # [B, width]
  return [np.concatenate([p, np.broadcast_to(own[:, None], p.shape[:2] + own.shape[1:])], -1) for p in before]


@pytest.mark.parametrize(
  "press, interval",
  tiered([("tova", 1), ("observed", 3), ("knorm", 3)], [("tova", 1), ("knorm", 3)]),
)
def test_chunks_and_decoding_under_a_budget_are_the_forward_masked_to_what_each_call_read(gqa, press, interval):
  """A ragged prompt (20 and 15 tokens) prefilled in chunks of 6 into a budget of 8, then 12
  decode steps: each call's logits are the full forward's whose queries read the budget held
  before the call and the call's own tokens; the cache never holds more than its slots."""
  model, params = gqa
  cache_config = budgeted(press, decode_budget=8, decode_interval=interval, prefill_chunk=6)
  cache = kinds.create(model.config, cache_config, 2, 40, prompt=20)
  assert cache.slots == 8 + 6
  history, calls = [], []
  for start in range(0, 20, 6):
    part = np.clip(LENGTHS - start, 0, 6).astype(np.int32)
    before = None if start == 0 else held(cache)
    logits, cache = decode.extend(model, params, cache, TOKENS[:, start : start + 6], part)
    if before is not None:
      history.append(
        (np.minimum(LENGTHS, start), np.minimum(LENGTHS, start) + part, read_by(before, start + 0 * part, start + part))
      )
    calls += [(b, start + c, logits[b, c]) for b in range(2) for c in range(int(part[b]))]
    assert ((held(cache)[0] >= 0).sum(-1) <= 8).all()  # every chunk pressed into the budget
  for step in range(12):
    position = LENGTHS + step
    before = held(cache)
    logits, cache = decode.decode_step(model, params, cache, TOKENS[np.arange(2), position])
    history.append((position, position + 1, read_by(before, position, position + 1)))
    calls += [(b, int(position[b]), logits[b]) for b in range(2)]
    count = (held(cache)[1] >= 0).sum(-1)
    assert (count <= 8 + interval - 1).all() and (count >= 8).all()
  reference = forward(model, params, TOKENS[:, :32], KeptForward(masks_of(history, 32)))
  for b, position, got in calls:
    np.testing.assert_allclose(got, reference[b, position], atol=1e-4, err_msg=f"row {b}, position {position}")
  pressed, _ = decode.prefill(model, params, TOKENS[:, :20], LENGTHS, 32, cache_config=cache_config, logits="last")
  np.testing.assert_allclose(pressed, reference[np.arange(2), LENGTHS - 1], atol=1e-4)


def np_weights(q, k):
  """Softmax weights of one query q [N, H] over keys k [K, S, H] -> [K, G, S] (float64)."""
  kv, _, h = k.shape
  s = q.reshape(kv, -1, h) @ k.transpose(0, 2, 1) / np.sqrt(h)  # [K, G, S]
  s = np.exp(s - s.max(-1, keepdims=True))
  return s / s.sum(-1, keepdims=True)


@pytest.mark.parametrize("press", [TOVA, ObservedAttention])
def test_tova_and_h2o_decode_rules_drop_the_victims_their_definitions_choose(press):
  """One decode step into held slots of random keys (row 0 full, row 1 below its slots): TOVA
  drops the token the step's query attends to least averaged over every query head; H2O the
  lowest score after adding each head group's mean attention of the step (the arrival starting
  from 0)."""
  config = tiny_config(2, num_heads=6, head_dim=8)
  cache = EvictedCache.rows(config, 2, 64, CacheConfig(press=press(decode_budget=6)))
  assert cache.slots == 7
  rng = np.random.default_rng(4)
  spec = cache.layer_spec(config, 0)
  stored = {name: np.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}
  stored["k"] = rng.normal(size=spec["k"][0]).astype(np.float32)  # [B, K, H, S]
  stored["v"] = rng.normal(size=spec["v"][0]).astype(np.float32)
  stored["scores"] = rng.random(spec["scores"][0]).astype(np.float32)
  stored["positions"] = np.array([[0, 3, 4, 6, 8, 9, -1], [1, 2, 5, 7, 9, -1, -1]])[:, None].repeat(2, 1)
  q = rng.normal(size=(2, 1, 6, 8)).astype(np.float32)
  new = {"k": rng.normal(size=(2, 2, 1, 8)).astype(np.float32), "v": rng.normal(size=(2, 2, 1, 8)).astype(np.float32)}
  at = np.array([[10], [12]], np.int32)
  span = Span(jnp.asarray(at), jnp.ones(2, jnp.int32))
  stored_jax = {name: jnp.asarray(x) for name, x in stored.items()}
  out, _ = cache.attend(
    stored_jax, KVQuery(jnp.asarray(q)), jnp.asarray(at), {n: jnp.asarray(x) for n, x in new.items()}, span, XLA
  )
  got = np.asarray(out["positions"])
  for b, held_before in enumerate((6, 5)):
    slots = list(range(held_before))
    keys = np.concatenate([stored["k"][b][:, :, slots].transpose(0, 2, 1), new["k"][b]], axis=1)  # [K, held + 1, H]
    positions = [*stored["positions"][b, 0, slots], at[b, 0]]
    w = np_weights(q[b, 0].astype(np.float64), keys.astype(np.float64))
    for head in range(2):
      if press is TOVA:
        score = w.mean(axis=(0, 1))
      else:
        score = np.concatenate([stored["scores"][b, head, slots], [0.0]]) + w[head].mean(axis=0)
      want = sorted(positions)
      if held_before + 1 == cache.slots:  # full: the worst goes
        want.remove(positions[int(np.argmin(score))])
      assert sorted(got[b, head][got[b, head] >= 0]) == want, (b, head)


def test_a_long_generation_under_a_budget_keeps_constant_memory(gqa):
  model, params = gqa
  cache_config = budgeted("streaming_llm", decode_budget=8, decode_interval=4)
  sizes = {kinds.cache_bytes(model.config, cache_config, 1, n, prompt=20) for n in (24, 40, 64)}
  assert sizes == {kinds.cache_bytes(model.config, CacheConfig(press=StreamingLLM(sinks=2)), 1, 12)}
  tokens = decode.generate(model, params, TOKENS[:1, :20], [20], 40, cache_config=cache_config)
  assert tokens.shape == (1, 40)


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda: TOVA(decode_budget=-1), "TOVA.decode_budget must be a non-negative integer, got -1"),
    (lambda: KNorm(decode_interval=0), "KNorm.decode_interval must be a positive integer, got 0"),
    (lambda: KNorm(prefill_chunk=1.5), "KNorm.prefill_chunk must be a non-negative integer, got 1.5"),
    (lambda: KNorm(prefill_chunk=8), "KNorm.prefill_chunk=8 needs a decode_budget"),
    (lambda: KNorm(decode_budget=8, heads="adaptive"), "KNorm.decode_budget=8 presses every head to the same budget"),
    (
      lambda: EvictedCache.rows(tiny_config(2), 1, 32, CacheConfig(press=SnapKV(window=8, decode_budget=4))),
      r"SnapKV.decode_budget=4 is smaller than the 8 tokens SnapKV\(",
    ),
  ],
)
def test_bad_budget_fields_are_refused_naming_the_field(make, message):
  with pytest.raises(ValueError, match=message):
    make()
