"""leverage: the approximate statistical leverage of a prompt's keys before RoPE (Chari & Van Durme
2025, Compactor, arXiv 2507.08143), as kvpress's LeverageScorePress computes it. A row's keys,
centred over the row, are multiplied by a Gaussian sketch of `sketch_dimension` columns (X, one
row x_t per token); a token scores x_t (X^T X + 1e-2 I)^{-1} x_t^T, at least 0, z-scored over the
row (every head of it). A key far from the prompt's common directions scores high, whatever the
queries: the press is query-agnostic by construction.

The sketch is drawn once, from NumPy's generator seeded by `seed`: one [head_dim,
sketch_dimension] matrix for every layer, head and row, so the scores are a function of the
prompt. kvpress draws a fresh one from torch's stream at every call; its reference run
(experiments/kvpress_reference.py) is handed this one, so that both sides score alike. The ridge
is kvpress's first jitter (it retries larger ones only where the factorisation fails)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.presses.base import Press
from kvjax.fields import INT32_MAX, check_nonnegative, check_positive

RIDGE = 1e-2


def sketch(dim: int, columns: int, seed: int) -> np.ndarray:
  """The Gaussian sketch float32 [dim, columns], entries N(0, 1 / columns), of `seed`."""
  return (np.random.default_rng(seed).standard_normal((dim, columns)) / np.sqrt(columns)).astype(np.float32)


def unrotated(k: jax.Array, rope) -> jax.Array:
  """Keys k [B, K, T, H] rotated to positions 0..T-1, turned back (unchanged without RoPE)."""
  if rope is None:
    return k.astype(jnp.float32)
  b, _, t, _ = k.shape
  back = rope.rotate(k.astype(jnp.float32).swapaxes(1, 2), jnp.broadcast_to(-jnp.arange(t), (b, t)))
  return back.swapaxes(1, 2)


def cholesky(gram: jax.Array) -> jax.Array:
  """The lower Cholesky factor of symmetric positive definite gram [..., c, c], column by column
  in XLA's own operations: jaxlib's LAPACK kernels on CPU wait on the thread pool they run in,
  and two of them at once (two layers' presses) can hold every thread of a 2-core pool."""
  c = gram.shape[-1]
  index = jnp.arange(c)

  def column(j, low):
    done = (index < j).astype(gram.dtype)  # the columns already factored
    row = low[..., j, :] * done  # [..., c]: row j of the factor left of the diagonal
    pivot = jnp.sqrt(gram[..., j, j] - (row * row).sum(axis=-1))
    below = (gram[..., :, j] - jnp.einsum("...ik,...k->...i", low * done, row)) / pivot[..., None]
    return low.at[..., :, j].set(jnp.where(index > j, below, jnp.where(index == j, pivot[..., None], 0.0)))

  return jax.lax.fori_loop(0, c, column, jnp.zeros_like(gram))


def forward_solve(low: jax.Array, b: jax.Array) -> jax.Array:
  """low^{-1} b for lower triangular low [..., c, c] and b [..., c, T], row by row (as `cholesky`)."""

  def row(i, y):
    y_i = b[..., i, :] - jnp.einsum("...k,...kt->...t", low[..., i, :] * (jnp.arange(low.shape[-1]) < i), y)
    return y.at[..., i, :].set(y_i / low[..., i, i][..., None])

  return jax.lax.fori_loop(0, low.shape[-1], row, jnp.zeros_like(b))


def leverage_scores(k: jax.Array, keep: jax.Array, matrix: np.ndarray) -> jax.Array:
  """Leverage of the tokens where keep bool[B, T] is set among themselves: k [B, K, T, H] float32
  (before RoPE) -> float32 [B, K, T], 0 elsewhere. x_t G^{-1} x_t^T = |L^{-1} x_t|^2 for G = L L^T."""
  mask = keep[:, None, :, None]
  count = jnp.maximum(keep.sum(axis=-1), 1)[:, None, None, None]
  mean = jnp.where(mask, k, 0.0).sum(axis=2, keepdims=True) / count
  x = jnp.where(mask, (k - mean) @ jnp.asarray(matrix), 0.0)  # [B, K, T, c]
  gram = jnp.einsum("bkti,bktj->bkij", x, x) + RIDGE * jnp.eye(matrix.shape[1], dtype=jnp.float32)
  solved = forward_solve(cholesky(gram), x.swapaxes(-1, -2))  # [B, K, c, T]
  return jnp.where(keep[:, None], (solved * solved).sum(axis=-2), 0.0)


def z_scored(scores: jax.Array, keep: jax.Array) -> jax.Array:
  """scores [B, K, T] less their mean over each row's kept columns (every head), over their
  standard deviation there (the unbiased one, as torch's; at least 1e-6)."""
  mask = jnp.broadcast_to(keep[:, None], scores.shape)
  n = mask.sum(axis=(1, 2), keepdims=True)
  mean = jnp.where(mask, scores, 0.0).sum(axis=(1, 2), keepdims=True) / jnp.maximum(n, 1)
  var = jnp.where(mask, (scores - mean) ** 2, 0.0).sum(axis=(1, 2), keepdims=True) / jnp.maximum(n - 1, 1)
  return (scores - mean) / jnp.maximum(jnp.sqrt(var), 1e-6)


@dataclasses.dataclass(frozen=True)
class LeverageScore(Press):
  sketch_dimension: int = 48
  seed: int = 0
  name: ClassVar[str] = "leverage"

  def __post_init__(self):
    super().__post_init__()
    check_positive(self, "sketch_dimension", most=INT32_MAX)
    check_nonnegative(self, "seed", most=2**63 - 1)

  @property
  def reads_channels(self) -> bool:
    return True  # the keys are turned back through RoPE's frequencies

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    keep = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    matrix = sketch(k.shape[-1], self.sketch_dimension, self.seed)
    return z_scored(leverage_scores(unrotated(k, rope), keep, matrix), keep)
