"""observed: H2O's observed attention, the attention each key receives summed over the queries
that see it, divided by their number, averaged over the group (Zhang et al. 2023, H2O). Under a
decode budget a held token's score accumulates the attention it receives at every call."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.presses.base import Press, causal_weights


@dataclasses.dataclass(frozen=True)
class ObservedAttention(Press):
  name: ClassVar[str] = "observed"

  def scores(self, q, k, lengths):
    t = k.shape[2]
    columns = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], jnp.arange(t)[None, :], -1)  # [B, T]
    total = causal_weights(q, k, columns, lengths).sum(axis=3)  # [B, K, G, T]
    seen_by = jnp.maximum(lengths[:, None] - jnp.arange(t)[None, :], 1)  # queries at or after each key
    return (total / seen_by[:, None, None]).mean(axis=2)

  @property
  def reads_attention(self) -> bool:
    return bool(self.decode_budget)

  def held_scores(self, scores, weights, valid, new):
    return jnp.where(new, 0.0, scores) + weights.sum(axis=3).mean(axis=2)  # H2O's accumulated attention
