"""Presses: how an evicting cache (kvjax.cache.evict) scores the tokens it may keep.

A press is a value, CacheConfig.press (e.g. SnapKV(compression_ratio=0.75, window=64)): a frozen
dataclass holding its settings, each checked in __post_init__. It scores every token of a prompt
per row and kv head, from the prompt's own queries and keys as the layer computes them, higher
meaning worth keeping; the cache keeps the int(n * (1 - compression_ratio)) best of a row's n
prompt tokens (NVIDIA kvpress's ScorerPress rule). Tokens that arrive later (extend, decode) get an
arrival score, and once a row's slots are full each arrival replaces the lowest-scoring token held.

Every press has, beside its own settings (the base class `Press`):
  compression_ratio  the fraction of a prompt's tokens dropped, in [0, 1);
  heads              "uniform" (every kv head keeps as many tokens) or "adaptive" (AdaKV, Feng et
                     al. 2024: a row's budget goes to its heads' best tokens together, each head
                     first keeping `safeguard` of its share; kvjax.cache.evict.head_budgets);
  safeguard          that share, in [0, 1] (read with heads="adaptive" only).
A press class sets `name`, and its definition enters it in PRESSES (kvjax.fields.Named): adding a
press is one class here. The command line chooses one by name and sets its fields:
`--set cache.press=snapkv cache.press.window=32 cache.press.compression_ratio=0.5`.

The presses, after their published definitions (and kvpress's reading of them):
  streaming_llm  the first `sinks` tokens and the most recent ones (Xiao et al. 2023). Arrivals
                 score their position: the oldest non-sink token goes first.
  snapkv         the attention that the prompt's last `window` queries pay to each earlier key,
                 averaged over those queries, smoothed by an average pool of `kernel` along the
                 sequence (zero padded) and over the query heads of each kv head; the window
                 itself is always kept (Li et al. 2024).
  tova           the attention of the prompt's last query, averaged over every query head (one
                 score for all kv heads); the last token is always kept (Oren et al. 2024).
  observed       H2O's observed attention: the attention each key receives summed over the
                 queries that see it, divided by their number, averaged over the group
                 (Zhang et al. 2023).
  knorm          minus the key's L2 norm: keys of low norm are kept (Devoto et al. 2024).
                 Arrivals score alike.
  random         uniform noise from `seed` and the position, a baseline.
The attention presses (snapkv, tova, observed) score arrivals above any attention weight, in
order of position: after the prefill's least attended tokens, the oldest arrivals go first.

Ties keep the earlier position. Every score is float32 [B, K, T].
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.fields import INT32_MAX, Named, check_choice, check_nonnegative, check_positive, check_real
from kvjax.model.attention import NEG_INF, group_queries, take_rows

# Arrivals of an attention press score RECENT + position: above every attention weight (at most 1,
# 2 for the always-kept tokens) and exact in float32 for positions below 2**22.
RECENT = float(2**22)


def attention_weights(q: jax.Array, k: jax.Array, columns: jax.Array, lengths: jax.Array) -> jax.Array:
  """Causal softmax attention of the queries at `columns` over a prompt's keys.

  Args:
    q: [B, T, N, H] every column's queries (rotated); k: [B, K, T, H] (rotated).
    columns: int[B, W], the query columns (negative: none; its weights are zero).
    lengths: int[B], the prompt's valid columns (keys past them are padding).
  Returns:
    float32 [B, K, G, W, T].
  """
  h = q.shape[-1]
  queries = group_queries(take_rows(q, jnp.maximum(columns, 0)), k.shape[1]) * h**-0.5  # [B, W, K, G, H]
  scores = jnp.einsum("bwkgh,bkth->bkgwt", queries, k.astype(q.dtype), preferred_element_type=jnp.float32)
  keys = jnp.arange(k.shape[2])
  seen = (keys[None, None, :] <= columns[:, :, None]) & (keys[None, None, :] < lengths[:, None, None])  # [B, W, T]
  weights = jax.nn.softmax(jnp.where(seen[:, None, None], scores, NEG_INF), axis=-1)
  return jnp.where((columns >= 0)[:, None, None, :, None], weights, 0.0)


HEADS = ("uniform", "adaptive")


@dataclasses.dataclass(frozen=True)
class Press(Named):
  """A scoring rule and how much it drops (module docstring). Subclasses set `name` and `scores`."""

  compression_ratio: float = 0.0
  heads: str = "uniform"
  safeguard: float = 0.2
  kinds: ClassVar[dict[str, type[Press]]] = {}

  def __post_init__(self):
    check_real(self, "compression_ratio", 0, 1, open_high=True)
    object.__setattr__(self, "compression_ratio", float(self.compression_ratio))
    check_choice(self, "heads", HEADS)
    check_real(self, "safeguard", 0, 1)
    object.__setattr__(self, "safeguard", float(self.safeguard))

  @property
  def min_slots(self) -> int:
    """The tokens this press always keeps (SnapKV's window, StreamingLLM's sinks): a row's slots
    may not be fewer."""
    return 0

  @property
  def storage_ratio(self) -> float:
    """The fraction of a prompt the evicting cache's slots leave out (kvjax.cache.evict.slots_for):
    the compression ratio, unless a press's heads may keep more than an even share."""
    return self.compression_ratio

  @property
  def uneven_heads(self) -> bool:
    """Whether heads of a row may keep different numbers of a prompt's tokens (the evicting cache
    then reads by positions)."""
    return self.heads == "adaptive"

  def scores(self, q: jax.Array, k: jax.Array, lengths: jax.Array) -> jax.Array:
    """q [B, T, N, H], k [B, K, T, H] of a prompt (columns = positions 0..T-1), lengths int[B]
    -> float32 [B, K, T]; columns past lengths[b] may hold anything (the cache never keeps them)."""
    raise NotImplementedError

  def arrival_scores(self, k: jax.Array, positions: jax.Array) -> jax.Array:
    """Scores of tokens written after the prompt: k [B, K, T, H] at positions int[B, T] -> [B, K, T]."""
    return jnp.broadcast_to(RECENT + positions[:, None, :].astype(jnp.float32), k.shape[:3])


def _last_columns(lengths: jax.Array, window: int) -> jax.Array:
  """int[B, window]: each row's last `window` columns, oldest first (negative where the row is shorter)."""
  return lengths[:, None] - window + jnp.arange(window)[None, :]


def _kept_above(scores: jax.Array, keep: jax.Array) -> jax.Array:
  """scores [B, K, T] with the columns where keep bool[B, T] is set raised above every other
  score of their row (to the row's maximum over all heads + 1, one value, as kvpress does):
  head-adaptive budgets compare scores across heads."""
  best = jnp.max(jnp.where(keep[:, None], -jnp.inf, scores), axis=(1, 2), keepdims=True)
  best = jnp.where(jnp.isfinite(best), best, 0.0)
  return jnp.where(keep[:, None], best + 1, scores)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Press):
  sinks: int = 4
  name: ClassVar[str] = "streaming_llm"

  def __post_init__(self):
    super().__post_init__()
    check_nonnegative(self, "sinks", most=INT32_MAX)

  @property
  def min_slots(self) -> int:
    return self.sinks

  def scores(self, q, k, lengths):
    position = jnp.arange(k.shape[2], dtype=jnp.float32)
    score = jnp.where(position < self.sinks, jnp.inf, position)
    return jnp.broadcast_to(score, k.shape[:3])

  def arrival_scores(self, k, positions):
    return jnp.broadcast_to(positions[:, None, :].astype(jnp.float32), k.shape[:3])


@dataclasses.dataclass(frozen=True)
class SnapKV(Press):
  window: int = 64
  kernel: int = 5
  name: ClassVar[str] = "snapkv"

  def __post_init__(self):
    super().__post_init__()
    check_positive(self, "window", "kernel", most=INT32_MAX)
    if self.kernel % 2 == 0:
      raise ValueError(f"SnapKV.kernel must be odd (a centred pool), got {self.kernel}")

  @property
  def min_slots(self) -> int:
    return self.window

  def scores(self, q, k, lengths):
    t = k.shape[2]
    columns = _last_columns(lengths, self.window)  # [B, W]
    weights = attention_weights(q, k, columns, lengths)  # [B, K, G, W, T]
    queries = jnp.maximum(jnp.minimum(lengths, self.window), 1)[:, None, None, None]
    score = weights.sum(axis=3) / queries  # [B, K, G, T]: the mean over the row's window queries
    before = jnp.arange(t)[None, :] < (lengths - self.window)[:, None]  # [B, T]: keys before the window
    score = jnp.where(before[:, None, None], score, 0.0)
    pad = self.kernel // 2
    score = jax.lax.reduce_window(
      score, 0.0, jax.lax.add, (1, 1, 1, self.kernel), (1, 1, 1, 1), ((0, 0),) * 3 + ((pad, pad),)
    )
    score = score.mean(axis=2) / self.kernel  # [B, K, T]
    window = (jnp.arange(t)[None, :] >= (lengths - self.window)[:, None]) & (jnp.arange(t)[None, :] < lengths[:, None])
    return _kept_above(jnp.where(before[:, None], score, -jnp.inf), window)


@dataclasses.dataclass(frozen=True)
class TOVA(Press):
  name: ClassVar[str] = "tova"

  def scores(self, q, k, lengths):
    t = k.shape[2]
    weights = attention_weights(q, k, (lengths - 1)[:, None], lengths)  # [B, K, G, 1, T]
    score = jnp.broadcast_to(weights.mean(axis=(1, 2, 3))[:, None], k.shape[:3])  # every query head's mean
    return _kept_above(score, jnp.arange(t)[None, :] == (lengths - 1)[:, None])


@dataclasses.dataclass(frozen=True)
class ObservedAttention(Press):
  name: ClassVar[str] = "observed"

  def scores(self, q, k, lengths):
    t = k.shape[2]
    columns = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], jnp.arange(t)[None, :], -1)  # [B, T]
    total = attention_weights(q, k, columns, lengths).sum(axis=3)  # [B, K, G, T]
    seen_by = jnp.maximum(lengths[:, None] - jnp.arange(t)[None, :], 1)  # queries at or after each key
    return (total / seen_by[:, None, None]).mean(axis=2)


@dataclasses.dataclass(frozen=True)
class KNorm(Press):
  name: ClassVar[str] = "knorm"

  def scores(self, q, k, lengths):
    return self.arrival_scores(k, None)

  def arrival_scores(self, k, positions):
    return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class Random(Press):
  seed: int = 0
  name: ClassVar[str] = "random"

  def __post_init__(self):
    super().__post_init__()
    check_nonnegative(self, "seed", most=INT32_MAX)

  def scores(self, q, k, lengths):
    # Noise per position, as for arrivals: a prompt's scores do not depend on its padding.
    return self.arrival_scores(k, jnp.broadcast_to(jnp.arange(k.shape[2]), k.shape[:1] + k.shape[2:3]))

  def arrival_scores(self, k, positions):
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(self.seed), positions.reshape(-1))
    noise = jax.vmap(lambda key: jax.random.uniform(key, (k.shape[1],)))(keys)  # [B * T, K]
    return noise.reshape(positions.shape + (k.shape[1],)).transpose(0, 2, 1)


PRESSES = Press.kinds  # {name: press class}, filled by the class definitions above


def make_press(name: str, **fields) -> Press:
  """The press called `name` with `fields` (a study holding press names builds its caches so);
  ValueError naming the press or field that is not one."""
  return Press.choose({"name": name, **fields}, "press")
