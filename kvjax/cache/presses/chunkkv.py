"""chunkkv: ChunkKV (Liu et al. 2025, arXiv 2502.00299), as kvpress's ChunkKVPress reads it: any
scorer's scores summed over a row's kv heads, averaged per chunk of `chunk_length` tokens (the
last, partial chunk over its own tokens), and the row keeps its max(1, int(chunks * (1 -
compression_ratio))) best chunks whole, the same tokens in every head. A prompt shorter than one
chunk is pressed by the scorer alone, token by token. The number of tokens kept depends on which
chunks win (a partial chunk is shorter), so the engine's pages, which must know it, refuse it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.cache.presses.base import Press, check_wrapper, kept
from kvjax.cache.presses.snapkv import SnapKV
from kvjax.fields import INT32_MAX, check_positive


@dataclasses.dataclass(frozen=True)
class ChunkKV(Press):
  scorer: Press = SnapKV()
  chunk_length: int = 20
  name: ClassVar[str] = "chunkkv"

  def __post_init__(self):
    super().__post_init__()
    check_wrapper(self, "keeps whole chunks, the same in every head and layer, of the prompt only")
    check_positive(self, "chunk_length", most=INT32_MAX)

  @property
  def min_slots(self) -> int:
    return 0  # whole chunks: even the scorer's always-kept tokens go if their chunk loses

  @property
  def reads_channels(self) -> bool:
    return self.scorer.reads_channels

  @property
  def grouped(self) -> bool:
    return True

  def most_kept(self, n: int) -> int:
    chunks = -(-n // self.chunk_length)
    return min(n, max(int(kept(n, self.compression_ratio)), int(self._kept_chunks(chunks)) * self.chunk_length))

  def _kept_chunks(self, chunks):
    return np.maximum(1, kept(chunks, self.compression_ratio))

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    return self.scorer.prompt_scores(q, k, v, lengths, rope, out)

  def arrival_scores(self, k, positions):
    return self.scorer.arrival_scores(k, positions)

  def regroup(self, scores, lengths):
    b, heads, t = scores.shape
    size = self.chunk_length
    column = jnp.arange(t)
    per_token = jnp.where(column[None] < lengths[:, None], scores.sum(axis=1), 0.0)  # [B, T]: over the kv heads
    count = -(-t // size)
    sums = jnp.zeros((b, count), jnp.float32).at[:, column // size].add(per_token)
    sizes = jnp.clip(lengths[:, None] - jnp.arange(count)[None] * size, 0, size)  # [B, C]: a chunk's tokens
    means = jnp.where(sizes > 0, sums / jnp.maximum(sizes, 1), -jnp.inf)
    table = self._kept_chunks(np.arange(count + 1))  # chunks kept of c chunks (host, float64 as Python)
    keep = jnp.asarray(table, jnp.int32)[-(-lengths // size)]  # [B]
    rank = jnp.argsort(jnp.argsort(-means, axis=-1, stable=True), axis=-1)  # ties: the earlier chunk
    chosen = rank < keep[:, None]  # [B, C]
    grouped = jnp.where(chosen, (count - rank).astype(jnp.float32), -jnp.inf)[:, column // size]  # [B, T]
    grouped = jnp.broadcast_to(jnp.where(column[None] < lengths[:, None], grouped, -jnp.inf)[:, None], scores.shape)
    counts = jnp.broadcast_to(jnp.where(chosen, sizes, 0).sum(axis=-1)[:, None], (b, heads))
    # A prompt shorter than one chunk: the scorer's own tokens, int(n * (1 - ratio)) per head.
    short = (lengths < size)[:, None]
    alone = jnp.asarray(kept(np.arange(t + 1), self.compression_ratio), jnp.int32)[lengths]
    return (
      jnp.where(short[..., None], scores, grouped),
      jnp.where(short, jnp.minimum(alone, t)[:, None], counts).astype(jnp.int32),
    )
