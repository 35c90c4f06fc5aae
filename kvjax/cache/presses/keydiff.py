"""keydiff: minus the cosine similarity of each key with the anchor, the mean of the row's unit
keys per kv head, so distinctive keys are kept (Park et al. 2025, KeyDiff)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.presses.base import Press


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
