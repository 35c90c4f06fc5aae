"""criticalkv: CriticalKV (Feng et al. 2025, arXiv 2502.03805), as kvpress's CriticalKVPress reads
it: a wrapper over any scorer that also weighs what a token's value adds to the layer's output. Of
a row's n tokens, the scorer's int((1 - compression_ratio) * n * first_stage_ratio) best (at least
one while first_stage_ratio > 0) are kept first in every head; the others then rank by (score +
epsilon) x the L1 norm of the value's image under the layer's output projection, v W_o of each
query head, averaged over the query heads of its kv head. The output projection is the layer's
own (KVQuery.out), in whichever format its weights are stored; the selection depends on the
ratio, so a CriticalKV at one ratio does not share its scoring with another."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.cache.presses.base import Press, check_wrapper, kept_above
from kvjax.cache.presses.snapkv import SnapKV
from kvjax.fields import check_real


@dataclasses.dataclass(frozen=True)
class CriticalKV(Press):
  scorer: Press = SnapKV()
  epsilon: float = 1e-4
  first_stage_ratio: float = 0.5
  name: ClassVar[str] = "criticalkv"

  def __post_init__(self):
    super().__post_init__()
    check_wrapper(self, "selects a prompt's tokens in two stages under one uniform budget")
    check_real(self, "epsilon", 0, float("inf"))
    check_real(self, "first_stage_ratio", 0, 1)
    for name in ("epsilon", "first_stage_ratio"):
      object.__setattr__(self, name, float(getattr(self, name)))

  @property
  def scoring(self) -> Press:
    return self  # its scores depend on the compression ratio

  @property
  def reads_channels(self) -> bool:
    return self.scorer.reads_channels

  def arrival_scores(self, k, positions):
    return self.scorer.arrival_scores(k, positions)

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    if out is None:
      raise ValueError("CriticalKV weighs values by the layer's output projection, which this layer does not hand over")
    b, heads, t, h = k.shape
    valid = (jnp.arange(t)[None, :] < lengths[:, None])[:, None]  # [B, 1, T]
    scores = jnp.where(valid, self.scorer.prompt_scores(q, k, v, lengths, rope, out), -jnp.inf)
    n = np.arange(t + 1, dtype=np.float64)  # the first stage's budget of each length, as Python computes it
    first = ((1 - self.compression_ratio) * n * self.first_stage_ratio).astype(np.int64)
    if self.first_stage_ratio > 0:
      first = np.maximum(first, 1)
    budget = jnp.asarray(first, jnp.int32)[lengths][:, None, None]
    rank = jnp.argsort(jnp.argsort(-scores, axis=-1, stable=True), axis=-1)  # ties: the earlier position
    projected = out.reshape(heads, -1, h, out.shape[-1])  # [K, G, H, D]
    image = jnp.einsum("bkth,kghd->bkgtd", v.astype(jnp.float32), projected)
    weighted = (scores + self.epsilon) * jnp.abs(image).sum(axis=-1).mean(axis=2)  # [B, K, T]
    return kept_above(jnp.where(valid, weighted, -jnp.inf), (rank < budget) & valid)
