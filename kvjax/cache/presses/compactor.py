"""compactor: Compactor (Chari & Van Durme 2025, arXiv 2507.08143), as kvpress's CompactorPress
reads it: the leverage of a token's key (kvjax.cache.presses.leverage) blended with a non-causal,
chunked attention score, both z-scored over the row, `blending` x leverage + attention; the first
`sinks_start` and the last `sinks_end` tokens of a row are kept and the rest scored among
themselves. `blending` unset is the compression ratio (kvpress's default), so the scores depend on
the ratio and a Compactor at one ratio does not share its scoring with another (`scoring`).

The attention score, kvpress's NonCausalAttnPress: the scored tokens are cut into chunks of
`chunk_size`; each query of a chunk attends over every key of its chunk (no causal mask, no
1/sqrt(head_dim) scale: kvpress's product), the weights summed over the chunk's queries, averaged
over the query heads of a kv head, times the value's norm, averaged over 3 neighbours (zero padded
at the ends). The last chunk is padded to `chunk_size` as kvpress pads it: its padding keys enter
the softmax with logit 0, and each padding query adds 1 / chunk_size to every column of the chunk.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.presses.base import Press, kept_above
from kvjax.cache.presses.leverage import leverage_scores, sketch, unrotated, z_scored
from kvjax.fields import INT32_MAX, check_nonnegative, check_positive, check_real


@dataclasses.dataclass(frozen=True)
class Compactor(Press):
  sinks_start: int = 8
  sinks_end: int = 4
  chunk_size: int = 256
  sketch_dimension: int = 48
  blending: float | None = None
  seed: int = 0
  name: ClassVar[str] = "compactor"

  def __post_init__(self):
    super().__post_init__()
    check_nonnegative(self, "sinks_start", "sinks_end", most=INT32_MAX)
    check_positive(self, "chunk_size", "sketch_dimension", most=INT32_MAX)
    check_nonnegative(self, "seed", most=2**63 - 1)
    if self.blending is not None:
      check_real(self, "blending", 0, float("inf"))
      object.__setattr__(self, "blending", float(self.blending))

  @property
  def weight(self) -> float:
    """The leverage's weight in the blend."""
    return self.compression_ratio if self.blending is None else self.blending

  @property
  def scoring(self) -> Press:
    return dataclasses.replace(super().scoring, blending=self.weight)

  @property
  def min_slots(self) -> int:
    return self.sinks_start + self.sinks_end

  @property
  def reads_channels(self) -> bool:
    return True  # the leverage turns keys back through RoPE's frequencies

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    t = k.shape[2]
    column = jnp.arange(t)[None, :]
    left = jnp.minimum(lengths, self.sinks_start)[:, None]
    right = jnp.minimum(self.sinks_end, jnp.maximum(0, lengths[:, None] - left))
    scored = (column >= left) & (column < lengths[:, None] - right)  # [B, T]
    matrix = sketch(k.shape[-1], self.sketch_dimension, self.seed)
    leverage = z_scored(leverage_scores(unrotated(k, rope), scored, matrix), scored)
    attention = z_scored(self._attention(q, k, v, scored), scored)
    blend = jnp.where(scored[:, None], self.weight * leverage + attention, -jnp.inf)
    sinks = (column < lengths[:, None]) & ~scored
    return kept_above(blend, sinks)

  def _attention(self, q, k, v, scored):
    """kvpress's non-causal chunked attention over the `scored` columns bool[B, T] (a row's from
    sinks_start on) -> [B, K, T], 0 outside them."""
    b, t, n, h = q.shape
    heads = k.shape[1]
    size, start = self.chunk_size, self.sinks_start
    count = max(-(-(t - start) // size), 1)
    pad = start + count * size - t
    span = lambda x, axis: jnp.pad(x, [(0, 0)] * axis + [(0, pad)] + [(0, 0)] * (x.ndim - axis - 1))[
      (slice(None),) * axis + (slice(start, None),)
    ]
    qs = span(q.astype(jnp.float32), 1).reshape(b, count, size, heads, n // heads, h)
    ks = span(k.astype(jnp.float32), 2).reshape(b, heads, count, size, h)
    dots = jnp.einsum("bcikgh,bkcjh->bkgcij", qs, ks)  # [B, K, G, C, Tq, Tk]
    real = scored.sum(axis=-1)  # [B]: the scored tokens of each row
    relative = jnp.arange(count * size).reshape(count, size)  # a column's place among the scored
    last = jnp.maximum(real - 1, 0) // size  # the chunk kvpress pads
    padded = (relative[None] >= real[:, None, None]) & (jnp.arange(count)[None, :, None] == last[:, None, None])
    is_real = relative[None] < real[:, None, None]  # [B, C, size]
    logits = jnp.where(
      is_real[:, None, None, :, None, :], dots, jnp.where(padded[:, None, None, :, None, :], 0.0, -jnp.inf)
    )
    weights = jnp.where(is_real[:, None, None, :, :, None], jax.nn.softmax(logits, axis=-1), 0.0)  # real queries
    # [B, K, G, C, size]: the real queries' weights, and 1 / size from each padding query
    sums = weights.sum(axis=-2) + (padded.sum(axis=-1, keepdims=True) / size)[:, None, None]
    per_column = sums.mean(axis=2).reshape(b, heads, count * size)  # over the query heads of a kv head
    norms = jnp.linalg.norm(span(v.astype(jnp.float32), 2), axis=-1)  # [B, K, C * size]
    mask = is_real.reshape(b, 1, count * size)
    score = jnp.where(mask, per_column * norms, 0.0)
    pooled = (
      score + jnp.pad(score, ((0, 0), (0, 0), (1, 0)))[..., :-1] + jnp.pad(score, ((0, 0), (0, 0), (0, 1)))[..., 1:]
    ) / 3
    back = jnp.pad(pooled, ((0, 0), (0, 0), (start, 0)))[..., :t]  # to the columns of the prompt
    return jnp.where(scored[:, None], back, 0.0)
