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
  safeguard          that share, in [0, 1] (read with heads="adaptive" only);
  layers             "uniform" (every layer keeps int(n * (1 - compression_ratio)) of a prompt's n
                     tokens) or "pyramid" (PyramidKV, Cai et al. 2024: budgets that shrink
                     linearly with depth, the same total over the layers; `layer_kept`, after
                     kvpress's PyramidKVPress, whose window is the press's min_slots: SnapKV's
                     window, 0 for a press that always keeps nothing);
  beta               the pyramid's steepness, an int >= 1 (the shallowest layer keeps about
                     2 - 1 / beta times the uniform budget, the deepest 1 / beta of it).
  decode_budget      tokens a row holds after each pressing during decoding (0: no pressing; the
                     slots follow max_len and compression_ratio). With a budget the cache has
                     decode_budget + max(decode_interval, prefill_chunk) slots whatever the length,
                     and presses a row back to the budget when its slots fill (every
                     decode_interval generated tokens) and after every call of several tokens;
  decode_interval    generated tokens between pressings (kvpress's DecodingPress compression_interval);
  prefill_chunk      a prompt longer than this is prefilled in chunks of it, each pressed into the
                     budget as it arrives (0: one call; needs decode_budget).
At a pressing a row drops its lowest-scoring held tokens (ties: the earlier position); the scores
are the arrival scores, except for the decode-time rules of TOVA (the attention of the call's last
query, averaged over every query head) and H2O (`observed`: each held token's score accumulates
the attention it receives at every call, averaged over its group; an arrival starts from the
attention of its own call), which need the call's attention weights (kvjax.cache.evict reads them
through XLA).
A press class sets `name`, and its definition enters it in PRESSES (kvjax.fields.Named): adding a
press is one class here. The command line chooses one by name and sets its fields:
`--set cache.press=snapkv cache.press.window=32 cache.press.compression_ratio=0.5`; a budget
composes with any scorer: `--set cache.press=snapkv cache.press.layers=pyramid` is kvpress's
PyramidKVPress, `cache.press.heads=adaptive` AdaKV's.

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
  keydiff        minus the cosine similarity of each key with the anchor, the mean of the row's
                 unit keys per kv head: distinctive keys are kept (Park et al. 2025, KeyDiff).
  expected_attention  the attention future queries are expected to pay each key (kvpress's
                 ExpectedAttentionPress): the mean mu and covariance C of the prompt's queries
                 before RoPE (its first `n_sink` left out) are carried by the rotation averaged
                 over the next `n_future_positions` positions, R; a key k scores
                 softmax_k(k.R mu / sqrt(H) + k.R C R^T k / (2 H)), the mean over the group,
                 times (that + epsilon) * |v| (use_vnorm); the first n_sink tokens are kept.
                 It reads the values and un-rotates the queries by the layer's RoPE
                 (`prompt_scores`).
The attention presses (snapkv, tova, observed) score arrivals above any attention weight, in
order of position: after the prefill's least attended tokens, the oldest arrivals go first.

Ties keep the earlier position. Every score is float32 [B, K, T].
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.fields import INT32_MAX, Named, check_choice, check_nonnegative, check_positive, check_real
from kvjax.model.attention import NEG_INF, group_queries, take_rows
from kvjax.model.rope import Rope

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
LAYERS = ("uniform", "pyramid")


@dataclasses.dataclass(frozen=True)
class Press(Named):
  """A scoring rule and how much it drops (module docstring). Subclasses set `name` and `scores`."""

  compression_ratio: float = 0.0
  heads: str = "uniform"
  safeguard: float = 0.2
  layers: str = "uniform"
  beta: int = 20
  decode_budget: int = 0
  decode_interval: int = 1
  prefill_chunk: int = 0
  kinds: ClassVar[dict[str, type[Press]]] = {}

  def __post_init__(self):
    check_real(self, "compression_ratio", 0, 1, open_high=True)
    object.__setattr__(self, "compression_ratio", float(self.compression_ratio))
    check_choice(self, "heads", HEADS)
    check_real(self, "safeguard", 0, 1)
    object.__setattr__(self, "safeguard", float(self.safeguard))
    check_choice(self, "layers", LAYERS)
    check_positive(self, "beta", most=INT32_MAX)
    check_nonnegative(self, "decode_budget", "prefill_chunk", most=INT32_MAX)
    check_positive(self, "decode_interval", most=INT32_MAX)
    if self.prefill_chunk and not self.decode_budget:
      raise ValueError(
        f"{type(self).__name__}.prefill_chunk={self.prefill_chunk} needs a decode_budget (the tokens each chunk is pressed into)"
      )
    if self.decode_budget and self.heads == "adaptive":
      raise ValueError(
        f"{type(self).__name__}.decode_budget={self.decode_budget} presses every head to the same budget; "
        "heads='adaptive' (AdaKV) budgets only the prompt"
      )

  @property
  def scorer(self) -> Press:
    """This press with its budgets (compression ratio, heads, layers, decode budget) at their
    defaults: two presses with the same scorer score a prompt alike, so one scoring serves every
    ratio and budget of it (kvjax.cache.fanout)."""
    return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(Press)})

  @property
  def headroom(self) -> int:
    """Slots above decode_budget: the most tokens a row takes between two pressings."""
    return max(self.decode_interval, self.prefill_chunk) if self.decode_budget else 0

  @property
  def reads_attention(self) -> bool:
    """Whether held_scores reads the call's attention weights (a decode-time rule under a budget)."""
    return False

  def held_scores(self, scores: jax.Array, weights: jax.Array, valid: jax.Array, new: jax.Array) -> jax.Array:
    """The scores of a row's held slots after a call under a decode budget: scores [B, K, S] as
    held, weights float32 [B, K, G, T, S] of the call's queries over the slots (zero for padding
    columns), valid bool[B, T] the call's real columns, new bool[B, K, S] the slots this call wrote."""
    return scores

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

  @property
  def reads_channels(self) -> bool:
    """Whether the scores read query or key channels one by one (through RoPE's frequencies): such
    a press cannot score a rotated cache (CacheConfig.rotation, kvjax.cache.rotation)."""
    return False

  def prompt_scores(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope: Rope | None) -> jax.Array:
    """What the evicting cache calls: `scores`, with the values v [B, K, T, H] and the layer's
    RoPE (None: learned positions) beside, for a press that reads them."""
    return self.scores(q, k, lengths)

  def layer_kept(self, lengths, layer: int, num_layers: int) -> np.ndarray:
    """Host side: the tokens layer `layer` of `num_layers` keeps of prompts of `lengths` (ints)
    -> int64 numpy, at most the length. "uniform": int(n * (1 - ratio)); "pyramid": kvpress's
    PyramidKVPress.get_layer_budget, in float64 as Python computes it (ratio 0 keeps all)."""
    n = np.asarray(lengths, np.int64)
    if self.layers == "uniform" or self.compression_ratio == 0:
      return (n.astype(np.float64) * (1 - self.compression_ratio)).astype(np.int64)
    return np.minimum(np.vectorize(lambda m: self._pyramid(int(m), layer, num_layers), otypes=[np.int64])(n), n)

  def _pyramid(self, n: int, layer: int, num_layers: int) -> int:
    window, share = self.min_slots, n * (1 - self.compression_ratio)
    low = share / self.beta
    high = share * 2 - low
    if high >= n - window:
      high = n - window
      low = share * 2 - high
    if not (n >= high >= low >= window):  # too short for a pyramid: the uniform budget, at least 1
      return max(1, round(n * (1 - self.compression_ratio)))
    steps = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return round(high - layer * steps)


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

  @property
  def reads_attention(self) -> bool:
    return bool(self.decode_budget)

  def held_scores(self, scores, weights, valid, new):
    last = jnp.maximum(valid.sum(axis=-1) - 1, 0)  # [B]: each row's last query of the call
    latest = jnp.take_along_axis(weights, last[:, None, None, None, None], axis=3)[:, :, :, 0]  # [B, K, G, S]
    score = jnp.broadcast_to(latest.mean(axis=(1, 2))[:, None], scores.shape)  # every query head's mean
    return jnp.where(valid.any(axis=-1)[:, None, None], score, scores)  # a row without tokens keeps its own


@dataclasses.dataclass(frozen=True)
class ObservedAttention(Press):
  name: ClassVar[str] = "observed"

  def scores(self, q, k, lengths):
    t = k.shape[2]
    columns = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], jnp.arange(t)[None, :], -1)  # [B, T]
    total = attention_weights(q, k, columns, lengths).sum(axis=3)  # [B, K, G, T]
    seen_by = jnp.maximum(lengths[:, None] - jnp.arange(t)[None, :], 1)  # queries at or after each key
    return (total / seen_by[:, None, None]).mean(axis=2)

  @property
  def reads_attention(self) -> bool:
    return bool(self.decode_budget)

  def held_scores(self, scores, weights, valid, new):
    return jnp.where(new, 0.0, scores) + weights.sum(axis=3).mean(axis=2)  # H2O's accumulated attention


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


@dataclasses.dataclass(frozen=True)
class KeyDiff(Press):
  name: ClassVar[str] = "keydiff"

  def scores(self, q, k, lengths):
    k = k.astype(jnp.float32)
    valid = (jnp.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, T, 1]
    norm = jnp.linalg.norm(k, axis=-1, keepdims=True)
    unit = k / jnp.maximum(norm, 1e-12)  # torch's F.normalize
    anchor = jnp.where(valid, unit, 0).sum(axis=2, keepdims=True) / jnp.maximum(lengths, 1)[:, None, None, None]
    cosine = (k * anchor).sum(-1) / jnp.maximum(norm[..., 0] * jnp.linalg.norm(anchor, axis=-1), 1e-8)
    return -cosine  # [B, K, T]


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(Press):
  n_future_positions: int = 512
  n_sink: int = 4
  use_covariance: bool = True
  use_vnorm: bool = True
  epsilon: float = 0.0
  name: ClassVar[str] = "expected_attention"

  @property
  def reads_channels(self) -> bool:
    return True

  def __post_init__(self):
    super().__post_init__()
    check_positive(self, "n_future_positions", most=INT32_MAX)
    check_nonnegative(self, "n_sink", most=INT32_MAX)
    for field in ("use_covariance", "use_vnorm"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"ExpectedAttention.{field} must be True or False, got {getattr(self, field)!r}")
    check_real(self, "epsilon", 0, float("inf"))
    object.__setattr__(self, "epsilon", float(self.epsilon))

  def scores(self, q, k, lengths):
    raise ValueError("expected_attention scores with the values and the layer's RoPE: call prompt_scores")

  def prompt_scores(self, q, k, v, lengths, rope):
    b, t, _, h = q.shape
    column = jnp.arange(t)[None, :]
    q = q.astype(jnp.float32)
    if rope is not None:  # the queries before RoPE: turned back from positions 0..T-1
      q = rope.rotate(q, jnp.broadcast_to(-column, (b, t)))
    counted = (column >= self.n_sink) & (column < lengths[:, None])  # [B, T]: the statistics' queries
    count = jnp.maximum(lengths - self.n_sink, 1).astype(jnp.float32)[:, None, None]
    mean = jnp.where(counted[..., None, None], q, 0).sum(axis=1) / count  # [B, N, H]
    centred = jnp.where(counted[..., None, None], q - mean[:, None], 0)
    cov = jnp.einsum("btni,btnj->bnij", centred, centred) / count[..., None] if self.use_covariance else None
    if rope is not None:  # the rotation averaged over positions n .. n + n_future_positions - 1
      ahead = (lengths[:, None] + jnp.arange(self.n_future_positions)[None, :]).astype(jnp.float32)  # [B, F]
      angle = ahead[..., None] * jnp.asarray(rope.freq)  # [B, F, H/2]
      cos, sin = jnp.cos(angle).mean(axis=1), jnp.sin(angle).mean(axis=1)  # [B, H/2]
      turn = jnp.block([[_diag(cos), -_diag(sin)], [_diag(sin), _diag(cos)]])  # [B, H, H]
      mean = jnp.einsum("bij,bnj->bni", turn, mean)
      if cov is not None:
        cov = jnp.einsum("bij,bnjl,bml->bnim", turn, cov, turn)
    kv = k.shape[1]
    keys = k.astype(jnp.float32)
    mean = mean.reshape(b, kv, -1, h)  # [B, K, G, H]
    logits = jnp.einsum("bkgh,bkth->bkgt", mean, keys) / h**0.5
    if cov is not None:
      cov = cov.reshape(b, kv, -1, h, h)  # [B, K, G, H, H]
      logits = logits + jnp.einsum("bkti,bkgij,bktj->bkgt", keys, cov, keys) / h / 2
    scored = (column >= self.n_sink) & (column < lengths[:, None])  # [B, T]: keys past the sinks
    weights = jax.nn.softmax(jnp.where(scored[:, None, None], logits, NEG_INF), axis=-1).mean(axis=2)  # [B, K, T]
    if self.use_vnorm:
      weights = (weights + self.epsilon) * jnp.linalg.norm(v.astype(jnp.float32), axis=-1)
    sinks = (column < self.n_sink) & (column < lengths[:, None])
    return _kept_above(jnp.where(scored[:, None], weights, -jnp.inf), sinks)


def _diag(x: jax.Array) -> jax.Array:
  """[B, W] -> [B, W, W] diagonal matrices."""
  return x[..., None] * jnp.eye(x.shape[-1], dtype=x.dtype)


PRESSES = Press.kinds  # {name: press class}, filled by the class definitions above


def make_press(name: str, **fields) -> Press:
  """The press called `name` with `fields` (a study holding press names builds its caches so);
  ValueError naming the press or field that is not one."""
  return Press.choose({"name": name, **fields}, "press")
