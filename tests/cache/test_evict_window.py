"""The evicting layout on models with sliding-window layers (kvjax.cache.layouts.evict): a press presses
the global layers only and each windowed layer keeps its window and sinks, so decoding equals the
full forward masked to the kept positions of each global layer and to the window of each local
one; ratio 0 is the contiguous cache; the bytes count windowed layers at their ring."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import init_params, tiered, tiny_config
from oracles import KeptForward, forward, held, masks_of

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import KNorm, SnapKV, StreamingLLM
from kvjax.decoding import decode
from kvjax.studies.base import measure

RNG = np.random.default_rng(3)
PRESSES = {
  "snapkv": SnapKV(compression_ratio=0.75, window=4),
  "knorm": KNorm(compression_ratio=0.75),
  "streaming_llm": StreamingLLM(compression_ratio=0.75, sinks=2),
  "adaptive": SnapKV(compression_ratio=0.75, window=4, heads="adaptive", safeguard=0.3),
}
# (how the windows are given, window pattern, sinks): the model's own, or a CacheConfig's on a
# model trained with full attention (StreamingLLM's windows).
WINDOWS = {
  "model (8, 0)": ("model", (8, 0), 0),
  "model (6, 6, 0) + 2 sinks": ("model", (6, 6, 0), 2),
  "cache (6, 0) + 3 sinks": ("cache", (6, 0), 3),
}


def made(how: str, window: tuple[int, ...], sinks: int, press):
  """(model, params, cache_config, windows per layer as (size, sinks)) of a 3-layer random model."""
  own = dict(window=window, sink_tokens=sinks) if how == "model" else {}
  model, params = init_params(tiny_config(2, num_layers=3, **own))
  overrides = dict(window=window, sink_tokens=sinks) if how == "cache" else {}
  return model, params, CacheConfig(press=press, **overrides), tuple((w, sinks if w else 0) for w in window)


@pytest.mark.parametrize(
  "press, windows",
  tiered(
    [
      ("snapkv", "model (8, 0)"),
      ("knorm", "model (6, 6, 0) + 2 sinks"),
      ("adaptive", "model (6, 6, 0) + 2 sinks"),
      ("streaming_llm", "cache (6, 0) + 3 sinks"),
    ],
    [("adaptive", "model (6, 6, 0) + 2 sinks"), ("streaming_llm", "cache (6, 0) + 3 sinks")],
  ),
)
def test_decoding_is_the_forward_masked_to_the_pressed_globals_and_the_windows(press, windows):
  """Ragged prompts (20 and 15 tokens, longer than every window), a chunk of 4, then 16 decode
  steps (past every window's wrap and the global layers' budget): every logit equals the full
  forward whose global layers read what each head held after the call and whose windowed layers
  read their window and sinks."""
  model, params, cache_config, per_layer = made(*WINDOWS[windows], PRESSES[press])
  lengths, total = np.array([20, 15]), 40
  tokens = RNG.integers(0, 64, (2, total)).astype(np.int32)
  cache = kinds.create(model.config, cache_config, 2, total, prompt=total)  # 40 - (40 - 10): 10 slots
  prompt = np.where(np.arange(20)[None, :] < lengths[:, None], tokens[:, :20], 0)
  logits, cache = decode.extend(model, params, cache, prompt, lengths)
  calls = [(b, p, logits[b, p]) for b in range(2) for p in range(lengths[b])]
  for i, positions in enumerate(held(cache)):
    width, sinks = per_layer[i % len(per_layer)]
    ring = cache.layers[f"layers_{i}"]["attn"]["v"].shape[2]
    if width:  # a ring of window + sinks, never pressed
      assert positions is None and ring == width + sinks, i
    else:  # the press kept int(n * 0.25) of each row's prompt (per head with adaptive budgets)
      assert (positions >= 0).sum(axis=(1, 2)).tolist() == [5 * 2, 3 * 2] and ring == cache.slots == 10, i
  history = []
  chunk = np.stack([tokens[b, lengths[b] : lengths[b] + 4] for b in range(2)])
  logits, cache = decode.extend(model, params, cache, chunk, [4, 4])
  history.append((lengths, lengths + 4, held(cache)))
  calls += [(b, lengths[b] + j, logits[b, j]) for b in range(2) for j in range(4)]
  for step in range(16):
    at = lengths + 4 + step
    logits, cache = decode.decode_step(model, params, cache, tokens[np.arange(2), at])
    history.append((at, at + 1, held(cache)))
    calls += [(b, at[b], logits[b]) for b in range(2)]
  pressed = [h for h in held(cache) if h is not None]
  assert all(((h >= 0).sum(-1) == cache.slots).all() for h in pressed)  # the budget is full: steps evicted
  reference = forward(model, params, tokens, KeptForward(masks_of(history, total, per_layer)))
  for b, position, got in calls:
    np.testing.assert_allclose(got, reference[b, position], atol=1e-4, err_msg=f"row {b} position {position}")


@pytest.mark.parametrize(
  "press, windows", [("snapkv", "model (6, 6, 0) + 2 sinks"), ("adaptive", "cache (6, 0) + 3 sinks")]
)
def test_ratio_zero_is_the_contiguous_cache_of_the_windowed_model(press, windows):
  """Nothing pressed: a ragged prefill (bucketed storage) and decode steps past the rings' wrap
  give the contiguous cache's logits, whose rings hold the same windows."""
  model, params, cache_config, _ = made(*WINDOWS[windows], dataclasses.replace(PRESSES[press], compression_ratio=0.0))
  contiguous = cache_config.replace(press=None, layout=None)
  tokens = RNG.integers(0, 64, (2, 24)).astype(np.int32)
  lengths = np.array([24, 17], np.int32)
  want, full = decode.prefill(model, params, tokens, lengths, 40, cache_config=contiguous)
  got, cache = decode.prefill(model, params, tokens, lengths, 40, cache_config=cache_config)
  np.testing.assert_allclose(got, want, atol=1e-5)
  for step in range(12):
    token = tokens[:, step]
    want, full = decode.decode_step(model, params, full, token)
    got, cache = decode.decode_step(model, params, cache, token)
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"step {step}")


KV = 2 * 2 * 8 * 4  # bytes of one position of one layer: K and V, 2 kv heads x 8 dims, float32
SLOT = KV + 2 * (4 + 4)  # and each kv head's int32 position and float32 score


@pytest.mark.parametrize(
  "own, override, rings",
  [
    (dict(window=(8, 0)), {}, [8, 8]),  # layers 0 and 2 windowed
    (dict(window=(8, 8, 0), sink_tokens=2), {}, [10, 10]),
    ({}, dict(window=(16, 0), sink_tokens=4), [20, 20]),
  ],
)
def test_bytes_count_windowed_layers_at_their_ring(own, override, rings):
  """3 layers: each windowed layer at window + sinks positions (no bookkeeping), each global one
  at the press's slots: 40 - (32 - 16) = 24 for a 32-token prompt at ratio 0.5 in 40 positions."""
  config = tiny_config(2, num_layers=3, **own)
  cache_config = CacheConfig(press=KNorm(compression_ratio=0.5), **override)
  globals_ = 3 - len(rings)
  row = sum(rings) * KV + globals_ * 24 * SLOT
  assert kinds.cache_bytes(config, cache_config, 3, 40, prompt=32) == 3 * row + 3 * 4
  assert kinds.create(config, cache_config, 3, 40, prompt=32).nbytes == 3 * row
  # A 64-token prompt in a cache of 64 positions: the globals keep 32 slots, the rings their window.
  per_token = (sum(rings) * KV + globals_ * 32 * SLOT + 4) / 64
  assert measure.kv_bytes_per_token(config, cache_config, 64) == per_token
  model, params = init_params(config)
  _, cache = decode.prefill(model, params, np.zeros((1, 64), np.int32), np.array([64]), 64, cache_config=cache_config)
  assert (cache.nbytes + 4) / 64 == per_token


@pytest.mark.parametrize(
  "own, override, message",
  [
    (dict(window=(8,)), {}, r"presses the global layers \(window 0\), but the model's window=\(8,\) windows every"),
    ({}, dict(window=(8, 16)), r"but CacheConfig.window's window=\(8, 16\) windows every layer, so nothing is left"),
  ],
)
def test_a_press_with_no_global_layer_is_refused(own, override, message):
  with pytest.raises(ValueError, match=message):
    kinds.create(tiny_config(2, **own), CacheConfig(press=SnapKV(window=4), **override), 1, 32)
