"""Which tokens a press keeps, for every evicting layout (kvjax.cache.layouts.evict, kvjax.cache.layouts.paged_evict,
KVzip's model-level prefill), and which press a layout and a model can take.

A layer's press scores a prompt's tokens per row and kv head (kvjax.cache.presses); this module
turns the scores into what the layer stores:
  the budget   how many tokens each head keeps: int(n * (1 - ratio)) of a row's n prompt tokens
               (`kept`), per layer with a pyramid (`layer_kept`, PyramidKV), per head with AdaKV
               (`head_budgets`), at most the decode budget;
  the order    best first, ties the earlier position (`best_first`): a layout stores a head's
               kept tokens in slots 0, 1, ... in that order, so every layout keeps the same tokens
               and reads them alike;
  the budget while decoding  (a press's decode_budget: kvpress's DecodingPress and chunked
               prefill): a row holding decode_budget + decode_interval tokens, or whose call
               brought several, drops its lowest-scoring held tokens down to decode_budget
               (`press_to_budget`), so a query reads the budget and its own call's tokens and the
               cache's memory is constant however long the generation. Dropped tokens leave
               holes (position -1), which the next call's tokens fill; reads go by positions.

`check` decides, from a press's declared properties, whether a layout can hold what it keeps on
a model, and names the reason when it cannot: one place for every press x layout x model refusal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.presses import Press
from kvjax.cache.presses.base import kept
from kvjax.config import ModelConfig
from kvjax.model.transformer import cache_payload


def layer_kept(press: Press, lengths, layer: int, num_layers: int) -> np.ndarray:
  """Host side: the tokens layer `layer` of `num_layers` keeps of prompts of `lengths` (ints)
  -> int64 numpy, at most the length. layers="uniform": `kept`; "pyramid": kvpress's
  PyramidKVPress.get_layer_budget, in float64 as Python computes it (ratio 0 keeps all)."""
  n = np.asarray(lengths, np.int64)
  if press.layers == "uniform" or press.compression_ratio == 0:
    return kept(n, press.compression_ratio)
  one = lambda m: _pyramid(press, int(m), layer, num_layers)
  return np.minimum(np.vectorize(one, otypes=[np.int64])(n), n)


def _pyramid(press: Press, n: int, layer: int, num_layers: int) -> int:
  window, share = press.min_slots, n * (1 - press.compression_ratio)
  low = share / press.beta
  high = share * 2 - low
  if high >= n - window:
    high = n - window
    low = share * 2 - high
  if not (n >= high >= low >= window):  # too short for a pyramid: the uniform budget, at least 1
    return max(1, round(n * (1 - press.compression_ratio)))
  steps = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
  return round(high - layer * steps)


def head_budgets(scores: jax.Array, keep: jax.Array, safeguard: float) -> jax.Array:
  """AdaKV's head-adaptive budgets (Feng et al. 2024): the tokens each kv head keeps when a row
  keeps its K * keep[b] best tokens over all its heads together, every head first keeping its
  int(keep * safeguard) best. scores [B, K, T] (-inf: padding), keep int[B] -> int[B, K]."""
  b, k, t = scores.shape
  rank = jnp.argsort(jnp.argsort(-scores, axis=-1, stable=True), axis=-1)  # each token's rank in its head
  safe = (keep * safeguard).astype(jnp.int32)
  boosted = jnp.where(rank < safe[:, None, None], jnp.inf, scores).reshape(b, k * t)
  flat_rank = jnp.argsort(jnp.argsort(-boosted, axis=-1, stable=True), axis=-1)  # ties: lower head, earlier position
  return (flat_rank < (k * keep)[:, None]).reshape(b, k, t).sum(axis=-1, dtype=jnp.int32)


def counts(press: Press, scores: jax.Array, lengths: jax.Array, layer: int, num_layers: int, room=None) -> jax.Array:
  """int[B, K]: the prompt tokens each kv head of layer `layer` keeps, from the press's scores
  float32 [B, K, T] (-inf: padding) of prompts of lengths int[B]: the layer's budget, at most the
  decode budget, shared out over the heads by AdaKV's rule with heads="adaptive" (each at most
  `room`, the slots a head may fill)."""
  t = scores.shape[-1]
  keep = jnp.asarray(layer_kept(press, np.arange(t + 1), layer, num_layers), jnp.int32)[lengths]  # [B]
  if press.decode_budget:
    keep = jnp.minimum(keep, press.decode_budget)
  if press.heads == "adaptive":
    return jnp.minimum(head_budgets(scores, keep, press.safeguard), room)
  return jnp.broadcast_to(jnp.minimum(keep, t)[:, None], scores.shape[:2])


def choose(press: Press, scores: jax.Array, lengths: jax.Array, layer: int, num_layers: int, room=None):
  """(scores, counts int[B, K]): what a layer keeps of prompts of lengths int[B] scored by `press`
  (float32 [B, K, T], -inf: padding): the press's own groups (Press.regroup) or each token on its
  own under the budget (`counts`). A layout keeps each head's counts best, best first."""
  grouped = press.regroup(scores, lengths)
  return grouped if grouped is not None else (scores, counts(press, scores, lengths, layer, num_layers, room))


def best_first(scores: jax.Array, width: int) -> jax.Array:
  """int[B, K, width]: each head's columns of scores [B, K, T] best first (ties: the earlier),
  cut or padded (with column 0) to `width` slots."""
  order = jnp.argsort(-scores, axis=-1, stable=True)[..., :width]
  if order.shape[-1] < width:  # a prompt shorter than the slots: the rest stay empty
    order = jnp.pad(order, ((0, 0), (0, 0), (0, width - order.shape[-1])))
  return order


def gather_best(new: dict, scores: jax.Array, positions: jax.Array, width: int):
  """Each head's tokens of new {name: [B, K, T, H]} at positions int[B, T], best first by scores
  float32 [B, K, T] (best_first, cut or padded to `width`) -> (order int[B, K, width], the tokens
  {name: [B, K, width, H]}, their positions int[B, K, width])."""
  order = best_first(scores, width)
  chosen = {name: jnp.take_along_axis(x, order[..., None], axis=2) for name, x in new.items()}
  return order, chosen, jnp.take_along_axis(jnp.broadcast_to(positions[:, None], scores.shape), order, axis=-1)


def press_to_budget(positions: jax.Array, scores: jax.Array, full, budget: int, several) -> jax.Array:
  """The positions int[B, K, S] a layer holds after a call (-1: empty): where a row holds `full`
  tokens (budget + decode_interval, or its slots) or the call brought `several` (a bool, or bool
  [B, 1] per row) and more than the budget, each head keeps its `budget` best-scoring held tokens
  (scores float32 [B, K, S]), dropping the lowest first and, of equal scores, the earlier position."""
  held = positions >= 0
  count = held.sum(axis=-1)  # [B, K]
  press = jnp.where(several, count > budget, count >= full)
  excess = jnp.where(press, jnp.maximum(count - budget, 0), 0)
  by_position = jnp.argsort(jnp.where(held, positions, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
  ranked = jnp.take_along_axis(jnp.where(held, scores, jnp.inf), by_position, axis=-1)
  order = jnp.take_along_axis(by_position, jnp.argsort(ranked, axis=-1, stable=True), axis=-1)  # worst first
  rank = jnp.argsort(order, axis=-1)  # each slot's place in that order
  return jnp.where(rank < excess[..., None], -1, positions)


def drop_lowest(positions: jax.Array, scores: jax.Array, excess: jax.Array, most: int) -> jax.Array:
  """press_to_budget's drop for at most `most` (static, small) tokens a head: excess int[B, K]
  (at most `most`) of each head's held tokens (positions int[B, K, S], -1 empty) dropped, the
  lowest score first and, of equal scores, the earlier position, by `most` passes of minima
  instead of sorting the slots."""
  out = positions
  for i in range(most):
    held = out >= 0
    s = jnp.where(held, scores, jnp.inf)
    tie = held & (s == s.min(axis=-1, keepdims=True))
    first = jnp.where(tie, out, jnp.iinfo(jnp.int32).max).min(axis=-1, keepdims=True)
    out = jnp.where(tie & (out == first) & (i < excess)[..., None], -1, out)
  return out


def refusal(config: ModelConfig, cache_config) -> str | None:
  """Why a model of `config` cannot keep what cache_config's press keeps in cache_config's layout
  ("evict" or "paged_evict"), from the press's declared properties; None when it can."""
  press, layout = cache_config.press, cache_config.layout
  payload = cache_payload(config)
  if set(payload) != {"k", "v"}:
    return (
      f"CacheConfig.press={press!r}: an evicting cache keeps tokens per kv head; the model caches "
      f"{sorted(payload)} (MLA's latent, shared by every head), which cannot be evicted per head"
    )
  model = cache_config.model(config)
  if model.all_windowed:
    whose = "the model's" if cache_config.window is None else "CacheConfig.window's"
    return (
      f"CacheConfig.press={press!r} presses the global layers (window 0), but {whose} window={model.window} "
      "windows every layer, so nothing is left to press: drop the press (the windows alone bound the cache) "
      "or leave a layer global"
    )
  if press.model_level and any(model.window):
    return (
      f"CacheConfig.press={press!r} scores keys in a model-level pass over global attention; the model's "
      f"layers are windowed ({model.window}), which it does not press (kvpress refuses Gemma 3 alike)"
    )
  if layout != "paged_evict":
    return None
  # The engine's pages: every head and layer of a row fills the same slots, nothing leaves them.
  reasons = (  # (refused, the field named, why)
    (press.model_level, "model_level", "it scores the prompt in a model-level pass, which the engine does not run"),
    (
      press.uneven_heads,
      "heads",
      "heads of a row keep different numbers of tokens, but a row's pages serve all its heads",
    ),
    (
      press.layers != "uniform",
      "layers",
      "layers keep different numbers of tokens, but a row fills one count of slots",
    ),
    (
      press.prefill_chunk > 0,
      "prefill_chunk",
      "it presses the prompt chunk by chunk, and the engine computes a pressed prompt in one call",
    ),
    (press.grouped, "grouped", "how many tokens it keeps depends on its scores, which the pages must know ahead"),
    (any(model.window), "window", f"the model's window={model.window} makes some layers sliding-window ones"),
  )
  for refused, field, reason in reasons:
    if refused:
      return (
        f"CacheConfig.press={press!r} ({field}): layout='paged_evict' cannot hold it: {reason}; use "
        "layout='evict' (prefill, generate) or the engine without a press"
      )
  return None


def check(config: ModelConfig, cache_config) -> None:
  """ValueError naming the reason unless a model of `config` can take cache_config's press in its layout."""
  reason = refusal(config, cache_config)
  if reason is not None:
    raise ValueError(reason)
