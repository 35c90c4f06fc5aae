"""streaming_llm: the first `sinks` tokens and the most recent ones (Xiao et al. 2023, StreamingLLM).
Arrivals score their position: the oldest non-sink token goes first."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.fields import INT32_MAX, check_nonnegative
from kvjax.cache.presses.base import Press


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
