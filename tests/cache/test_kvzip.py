"""KVzip (kvjax.cache.kvzip): the tokens it keeps are those a NumPy reading
of its definition keeps, the reconstruction run as a plain forward pass over the context and its
replay; decoding after it is the full forward masked to what each layer and head holds; the
combinations it cannot take are refused, named. (Ratio 0 is the contiguous cache:
tests/cache/test_evict.py runs every press so.)"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, tiered, tiny_config
from oracles import KeptForward, forward, held, masks_of

from kvjax.cache.config import CacheConfig
from kvjax.cache.kvzip import CONTINUED, KVzip
from kvjax.decoding import decode
from kvjax.model.attention import NoCache

RNG = np.random.default_rng(3)
TOKENS = RNG.integers(0, 64, (2, 24)).astype(np.int32)
LENGTHS = np.array([24, 19], np.int32)
PRESS = KVzip(sinks=2, chunk_size=8, prefix=3, repeat_ids=(5, 6, 7), resume_ids=(8, 9), suffix_ids=(10, 11))


class Recorded(NoCache):
  """The plain forward pass, keeping each layer's queries [T, N, H] and keys [K, T, H] (row 0)."""

  def __init__(self):
    self.lengths, self.q, self.k = jnp.zeros((1,), jnp.int32), [], []

  def attend(self, stored, query, q_positions, new, span, backend):
    self.q.append(np.asarray(query.q[0], np.float64))
    self.k.append(np.asarray(new["k"][0], np.float64))
    return super().attend(stored, query, q_positions, new, span, backend)


def np_kept(model, params, context: np.ndarray, press: KVzip) -> np.ndarray:
  """bool [L, K, n]: KVzip's kept tokens of one context, read from its definition: per chunk, the
  context and its replay through the plain forward pass; each layer's replay queries' softmax
  over the sinks, the chunk and the replay (causal); the max over queries and query heads."""
  n, cfg = len(context), model.config
  scores = np.zeros((cfg.num_layers, cfg.num_kv_heads, n))
  for start in range(press.prefix, n, press.chunk_size):
    end = min(start + press.chunk_size, n)
    head = list(press.repeat_ids) if start == press.prefix else [*press.resume_ids, *context[start - CONTINUED : start]]
    replay = np.array(head + list(press.suffix_ids) + list(context[start:end]))
    recorded = Recorded()
    model.apply({"params": params}, jnp.asarray(np.concatenate([context, replay])[None]), recorded)
    w = len(replay)
    keys = np.r_[np.arange(min(press.sinks, start)), np.arange(start, end), n + np.arange(w)]
    for layer, (q, k) in enumerate(zip(recorded.q, recorded.k)):
      for query_head in range(cfg.num_heads):
        kv = query_head // cfg.q_per_kv
        logits = q[n:, query_head] @ k[kv, keys].T / np.sqrt(cfg.head_dim)  # [W, keys]
        logits[:, -w:] = np.where(np.tril(np.ones((w, w), bool)), logits[:, -w:], -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        chunk = weights[:, min(press.sinks, start) : min(press.sinks, start) + end - start].max(0)
        scores[layer, kv, start:end] = np.maximum(scores[layer, kv, start:end], chunk)
  scores[..., : press.sinks] = scores.max() + 1
  keep = np.zeros(scores.shape, bool)
  for layer in range(1 if not press.layerwise else cfg.num_layers):
    part = scores if not press.layerwise else scores[layer : layer + 1]
    total = part.size
    best = np.argsort(-part.reshape(-1), kind="stable")[: total - int(np.floor(total * press.compression_ratio))]
    chosen = np.zeros(total, bool)
    chosen[best] = True
    keep[layer : layer + 1 if press.layerwise else None] = chosen.reshape(part.shape)
  return keep


@pytest.mark.parametrize(
  ("kv_heads", "layerwise", "ratio"), tiered([(2, False, 0.5), (1, True, 0.75)], [(1, True, 0.75)])
)
def test_kvzip_keeps_what_its_definition_keeps(kv_heads, layerwise, ratio):
  """Two ragged rows, three chunks (the later ones quoting the previous chunk's end), GQA and MQA:
  every layer and kv head holds the positions the NumPy reading keeps (no head short of slots)."""
  model, params = init_params(tiny_config(kv_heads, num_heads=4))
  press = dataclasses.replace(PRESS, compression_ratio=ratio, layerwise=layerwise)
  _, cache = decode.prefill(model, params, TOKENS, LENGTHS, 48, cache_config=CacheConfig(press=press))
  assert cache.slots >= TOKENS.shape[1]
  positions = held(cache)
  for b, n in enumerate(LENGTHS):
    want = np_kept(model, params, TOKENS[b, :n], press)
    for layer, got in enumerate(positions):
      for head in range(kv_heads):
        assert sorted(got[b, head][got[b, head] >= 0]) == list(np.flatnonzero(want[layer, head])), (b, layer, head)


def test_decoding_after_kvzip_is_the_forward_masked_to_the_kept_tokens():
  """Prefill (pressed by KVzip, heads holding different counts), a second turn, then decode past
  the slots (each step evicts): every call's logits equal the full forward whose queries read
  what the cache held."""
  model, params = init_params(tiny_config(2))
  tokens = RNG.integers(0, 64, (2, 40)).astype(np.int32)
  prompt, lengths = 20, np.array([20, 20], np.int32)
  press = dataclasses.replace(PRESS, compression_ratio=0.75, head_share=0.3)  # at most 6 of 20 per head
  _, cache = decode.prefill(model, params, tokens[:, :prompt], lengths, 30, cache_config=CacheConfig(press=press))
  counts = np.stack([(p >= 0).sum(-1) for p in held(cache)])  # [L, B, K]
  assert cache.room == 16 and (counts.sum(axis=(0, 2)) == 80 - 60).all() and counts.max() <= 6 and counts.min() < 5
  logits, cache = decode.extend(model, params, cache, tokens[:, prompt : prompt + 4], np.array([4, 4], np.int32))
  history = [(lengths, lengths + 4, held(cache))]
  calls, positions = [logits[:, -1]], [prompt + 3]
  for step in range(prompt + 4, 30):
    logits, cache = decode.decode_step(model, params, cache, tokens[:, step])
    history.append((np.full(2, step), np.full(2, step + 1), held(cache)))
    calls.append(logits)
    positions.append(step)
  reference = forward(model, params, tokens[:, :30], KeptForward(masks_of(history, 30)))
  for got, position in zip(calls, positions):
    np.testing.assert_allclose(got, reference[:, position], atol=1e-4, err_msg=f"position {position}")


def test_kvzip_refuses_what_it_cannot_take():
  model, params = init_params(tiny_config(2))
  with pytest.raises(ValueError, match="repeat prompt's token ids"):
    decode.prefill(model, params, TOKENS, LENGTHS, 32, cache_config=CacheConfig(press=KVzip(compression_ratio=0.5)))
  with pytest.raises(ValueError, match="KVzip.heads='adaptive'"):
    KVzip(heads="adaptive")
  with pytest.raises(ValueError, match="head_share=0.2 is less than"):
    KVzip(compression_ratio=0.5, head_share=0.2)
  with pytest.raises(ValueError, match="KVzip.repeat_ids"):
    KVzip(repeat_ids=(1, -2))
  with pytest.raises(ValueError, match="token id 99"):
    press = dataclasses.replace(PRESS, compression_ratio=0.5, suffix_ids=(99,))
    decode.prefill(model, params, TOKENS, LENGTHS, 32, cache_config=CacheConfig(press=press))
  windowed = CacheConfig(press=dataclasses.replace(PRESS, compression_ratio=0.5), window=(8, 0), sink_tokens=0)
  with pytest.raises(ValueError, match="windowed"):
    decode.prefill(model, params, TOKENS, LENGTHS, 32, cache_config=windowed)
