"""cur: CurDKV's leverage of keys and values (Sengupta et al. 2025, arXiv 2509.15038), as kvpress's
CURPress reads it: a token's squared key norm and squared value norm, each normalised within its
window of `window` tokens (the local approximation of a leverage score), combined by `leverage`
("key", "value", "kv_avg" their mean, "kv_product" their product), normalised over the row; the
first `sinks` tokens are kept."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.presses.base import Press
from kvjax.fields import INT32_MAX, check_choice, check_nonnegative, check_positive

LEVERAGES = ("key", "value", "kv_avg", "kv_product")


@dataclasses.dataclass(frozen=True)
class CUR(Press):
  sinks: int = 4
  leverage: str = "kv_product"
  window: int = 16
  name: ClassVar[str] = "cur"

  def __post_init__(self):
    super().__post_init__()
    check_nonnegative(self, "sinks", most=INT32_MAX)
    check_choice(self, "leverage", LEVERAGES)
    check_positive(self, "window", most=INT32_MAX)

  @property
  def min_slots(self) -> int:
    return self.sinks

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    valid = jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None]  # [B, 1, T]
    k2, v2 = (jnp.where(valid, (x.astype(jnp.float32) ** 2).sum(-1), 0.0) for x in (k, v))
    k2, v2 = self._local(k2), self._local(v2)
    combined = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage]
    combined = jnp.where(valid, combined, 0.0)  # windows wholly past the prompt are 0 / 0
    combined = combined / combined.sum(axis=-1, keepdims=True)
    return jnp.where(jnp.arange(k.shape[2]) < self.sinks, 1.0, combined)  # [B, K, T]

  def _local(self, x):
    """x [B, K, T] normalised within each window of `window` tokens (zeros past the prompt)."""
    b, h, t = x.shape
    w = self.window
    padded = jnp.pad(x, ((0, 0), (0, 0), (0, -t % w))).reshape(b, h, -1, w)
    return (padded / padded.sum(axis=-1, keepdims=True)).reshape(b, h, -1)[..., :t]
