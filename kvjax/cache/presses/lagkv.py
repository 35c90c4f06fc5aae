"""lagkv: LagKV's lag-relative scores (Liang et al. 2025, arXiv 2504.04704), as kvpress's LagKVPress
reads them. After `sinks` tokens the prompt is cut into partitions of `lag` tokens; each token of a
partition is scored by how far its key and its value stand out against the next partition (per
channel, min-max normalised by the next partition's range; the standard deviation over channels;
a softmax over the partition), keys and values averaged. Without `cross_scoring` a token scores its
rank within its partition over `lag`, so every partition keeps alike. The sinks and the last partial
partition with the one before it (no partition after them to lag against) are kept; a prompt
shorter than sinks + 2 lags keeps its sinks and then the most recent tokens."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.presses.base import Press
from kvjax.fields import INT32_MAX, check_nonnegative, check_positive


@dataclasses.dataclass(frozen=True)
class LagKV(Press):
  sinks: int = 4
  lag: int = 128
  cross_scoring: bool = False
  name: ClassVar[str] = "lagkv"

  def __post_init__(self):
    super().__post_init__()
    check_nonnegative(self, "sinks", most=INT32_MAX)
    check_positive(self, "lag", most=INT32_MAX)
    if not isinstance(self.cross_scoring, bool):
      raise ValueError(f"LagKV.cross_scoring must be True or False, got {self.cross_scoring!r}")

  @property
  def min_slots(self) -> int:
    return self.sinks

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    return jax.vmap(self._row, in_axes=(0, 0, 0))(k.astype(jnp.float32), v.astype(jnp.float32), lengths)

  def _row(self, k, v, n):
    """One row: k, v [K, T, H], its length n (traced) -> [K, T]."""
    heads, t, _ = k.shape
    sinks, lag = self.sinks, self.lag
    column = jnp.arange(t)
    short = (column - sinks).astype(jnp.float32) / jnp.maximum(n - sinks, 1)  # a prompt too short to lag
    short = jnp.where(column < sinks, 1.0, short)
    end = sinks + (n - sinks) // lag * lag  # the end of the whole partitions
    parts = max((t - sinks) // lag, 0)  # static: the most partitions a row of T columns holds
    if parts < 2:
      return jnp.broadcast_to(short, (heads, t))
    body = slice(sinks, sinks + parts * lag)
    score = (self._states(k[:, body], parts) + self._states(v[:, body], parts)) / 2  # [K, parts - 1, lag]
    if not self.cross_scoring:
      score = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1).astype(jnp.float32) / lag
    lagged = jnp.pad(score.reshape(heads, -1), ((0, 0), (sinks, t - sinks - (parts - 1) * lag)), constant_values=1.0)
    # The partition before `end` - lag and everything after it (and the sinks) keep 1; a column in
    # a partition whose next partition lies past the row's end has no reference: it keeps too.
    lagged = jnp.where((column < sinks) | (column >= end - lag), 1.0, lagged)
    return jnp.where(n < sinks + 2 * lag, short[None], lagged)

  def _states(self, x, parts):
    """x [K, parts * lag, H] -> [K, parts - 1, lag]: each token of partitions 0 .. parts - 2 scored
    against the next partition."""
    heads, _, h = x.shape
    x = x.reshape(heads, parts, self.lag, h)
    ref, cur = x[:, 1:], x[:, :-1]
    low, high = ref.min(axis=2, keepdims=True), ref.max(axis=2, keepdims=True)
    spread = ((cur - low) / (high - low)).std(axis=-1, ddof=1)  # torch's std: the unbiased one
    return jax.nn.softmax(spread, axis=-1)
