"""The references the cache tests compare with: the full forward pass, with each layer's payload
as a codec stores it. Not a test module: the tests of tests/cache import it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.codec import Codec
from kvjax.model.attention import NoCache, new_keys


class StoredForward(NoCache):
  """The plain forward pass (every query over the call's payload under its layer's window mask;
  MLA reads it expanded), with each layer's payload as `codec` stores it: decode(encode(x))."""

  def __init__(self, codec: Codec, batch: int):
    self.codec, self.lengths = codec, jnp.zeros((batch,), jnp.int32)

  def attend(self, stored, query, q_positions, new, span, backend):
    stored_new = {name: self.codec.roundtrip(x) for name, x in new.items()}
    return stored, query.attend(stored_new, new_keys(q_positions, span))


def forward(model, params, tokens, kind=None) -> np.ndarray:
  """The full forward's logits [B, T, V] over tokens int[B, T], through the cache kind `kind`
  (None: the plain forward), jitted (eager apply runs op by op)."""
  return np.asarray(jax.jit(lambda p, t: model.apply({"params": p}, t, kind))(params, tokens))


class KeptForward(NoCache):
  """The plain forward pass with each layer's attention masked per kv head: masks[l] bool
  [B, K, T, T] says which keys query t of layer l reads (an evicting cache's reference)."""

  def __init__(self, masks: list[np.ndarray]):
    self.masks, self.lengths, self.layer = masks, jnp.zeros((masks[0].shape[0],), jnp.int32), 0

  def attend(self, stored, query, q_positions, new, span, backend):
    mask = self.masks[self.layer % len(self.masks)]
    self.layer += 1
    return stored, query.attend(new, _FixedMask(jnp.asarray(mask)))


class _FixedMask:
  """A given [B, K, T, S] mask where attention takes a Visibility."""

  def __init__(self, mask):
    self.key_positions = mask[:, :, 0]  # [B, K, S]: per kv head, so attention reads the mask whole
    self._mask = mask

  def mask(self):
    return self._mask


def held(cache) -> list[np.ndarray | None]:
  """Per layer of an evicting cache, int[B, K, S] the positions each slot holds (-1 empty); None
  for a windowed layer (a ring, which keeps no positions)."""
  return [
    np.asarray(layer["attn"]["positions"]) if "positions" in layer["attn"] else None for layer in cache.layers.values()
  ]


def masks_of(history, total: int, windows: tuple[tuple[int, int], ...] = ()) -> list[np.ndarray]:
  """The reference masks [B, K, T, T] per layer of an evicting cache (KeptForward's). Every query
  reads the earlier tokens, in a windowed layer (windows[l] = (size, sinks); size 0 or none given:
  global) those within its window and the sinks: s <= t and (t - s < size or s < sinks). A query
  of a later call in a global layer reads the positions that layer and head held after the call.
  history: per call after the prompt, (first position int[B], last position + 1 int[B], held(cache))."""
  layers = len(history[0][2])
  b, k = next(h for h in history[0][2] if h is not None).shape[:2]
  t, s = np.arange(total)[:, None], np.arange(total)[None, :]
  causal = s <= t
  masks = []
  for layer in range(layers):
    size, sinks = windows[layer % len(windows)] if windows else (0, 0)
    mask = causal & ((t - s < size) | (s < sinks)) if size else causal
    masks.append(np.broadcast_to(mask, (b, k, total, total)).copy())
  for start, end, after in history:
    for layer, positions in enumerate(after):
      if positions is None:
        continue
      for row in range(b):
        for head in range(k):
          seen = np.zeros(total, bool)
          seen[positions[row, head][positions[row, head] >= 0]] = True
          rows = np.arange(start[row], end[row])
          masks[layer][row, head, rows] = seen[None, :] & causal[rows]
  return masks


def kept_by_press(press, q, k, v, lengths, rope, out=None) -> np.ndarray:
  """The positions int[B, K, S] (-1: empty) an evicting cache keeps of a prompt scored by `press`:
  q [B, T, N, H] rotated, k, v [B, K, T, H], lengths int[B] (a layer of a model of K kv heads),
  out [N, H, D] the layer's output projection (KVQuery.out) or None."""
  from kvjax.cache.config import CacheConfig
  from kvjax.cache.layouts.evict import EvictedCache
  from kvjax.config import ModelConfig
  from kvjax.model.attention import Span

  b, t, heads, h = q.shape
  config = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=1,
    num_heads=heads,
    num_kv_heads=k.shape[1],
    head_dim=h,
    mlp_dim=64,
    max_len=max(t, 64),
  )
  cache = EvictedCache.rows(config, b, t, CacheConfig(press=press), prompt=t)
  span = Span(jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.asarray(lengths), from_empty=True)
  new = {"k": jnp.asarray(k), "v": jnp.asarray(v)}
  stored = cache.compress(new, jnp.asarray(q), span, rope, out=None if out is None else jnp.asarray(out))
  return np.asarray(stored["positions"])


def check_kept(positions: np.ndarray, scores_of, lengths, ratio: float) -> None:
  """Each row and head of positions (kept_by_press) holds the int(n * (1 - ratio)) best of a
  NumPy reading's scores_of(b, n) -> [K, n] (ties: the earlier position)."""
  for b, n in enumerate(lengths):
    scores = scores_of(b, int(n))
    for head in range(positions.shape[1]):
      order = sorted(range(n), key=lambda s: (-scores[head, s], s))
      want = sorted(order[: int(n * (1 - ratio))])
      assert sorted(positions[b, head][positions[b, head] >= 0]) == want, (b, head)
