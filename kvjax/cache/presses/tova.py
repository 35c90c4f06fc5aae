"""tova: the attention of the prompt's last query, averaged over every query head (one score for
all kv heads); the last token is always kept (Oren et al. 2024, TOVA). Under a decode budget a
held token's score is the attention of each call's last query."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.presses.base import Press, causal_weights, kept_above


@dataclasses.dataclass(frozen=True)
class TOVA(Press):
  name: ClassVar[str] = "tova"

  def scores(self, q, k, lengths):
    t = k.shape[2]
    weights = causal_weights(q, k, (lengths - 1)[:, None], lengths)  # [B, K, G, 1, T]
    score = jnp.broadcast_to(weights.mean(axis=(1, 2, 3))[:, None], k.shape[:3])  # every query head's mean
    return kept_above(score, jnp.arange(t)[None, :] == (lengths - 1)[:, None])

  @property
  def reads_attention(self) -> bool:
    return bool(self.decode_budget)

  def held_scores(self, scores, weights, valid, new):
    last = jnp.maximum(valid.sum(axis=-1) - 1, 0)  # [B]: each row's last query of the call
    latest = jnp.take_along_axis(weights, last[:, None, None, None, None], axis=3)[:, :, :, 0]  # [B, K, G, S]
    score = jnp.broadcast_to(latest.mean(axis=(1, 2))[:, None], scores.shape)  # every query head's mean
    return jnp.where(valid.any(axis=-1)[:, None, None], score, scores)  # a row without tokens keeps its own
