"""snapkv: the attention that the prompt's last `window` queries pay to each earlier key, averaged
over those queries, smoothed by an average pool of `kernel` along the sequence (zero padded) and
over the query heads of each kv head; the window itself is always kept (Li et al. 2024, SnapKV)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.fields import INT32_MAX, check_positive
from kvjax.cache.presses.base import Press, causal_weights, kept_above, last_columns


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
    columns = last_columns(lengths, self.window)  # [B, W]
    weights = causal_weights(q, k, columns, lengths)  # [B, K, G, W, T]
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
    return kept_above(jnp.where(before[:, None], score, -jnp.inf), window)
