"""knorm: minus the key's L2 norm, so keys of low norm are kept (Devoto et al. 2024). Arrivals
score alike."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.presses.base import Press


@dataclasses.dataclass(frozen=True)
class KNorm(Press):
  name: ClassVar[str] = "knorm"

  def scores(self, q, k, lengths):
    return self.arrival_scores(k, None)

  def arrival_scores(self, k, positions):
    return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)
