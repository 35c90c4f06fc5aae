"""random: uniform noise from `seed` and the position, a baseline."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.fields import INT32_MAX, check_nonnegative
from kvjax.cache.presses.base import Press


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
