"""Rotations folded into a cache's query / key path: CacheConfig(rotation="hadamard").

A normalized Walsh-Hadamard matrix R over head_dim is orthogonal and symmetric (R = R^T = R^-1),
so q . k = (R q) . (R k) and sum_s p_s (R v_s) = R (sum_s p_s v_s). A cache with a rotation
stores R k and R v (rotated once, when written), its reads take R q (once per call), and the
attention output is turned back by R: the softmax weights and the output are those of the
unrotated cache, while each stored vector's energy is spread evenly over its elements. A few
outlier channels (RoPE'd keys have them) no longer take most of a quantized group's levels
(QuaRot, Ashkboos et al. 2024; llama.cpp's rotated q4_0 keys). Nothing is rotated per position
at read time: a decode step rotates its [B, 1, N, H] queries and outputs, never the cache.

A head_dim that is not a power of two takes a block-diagonal Hadamard: blocks of the largest
power of two that divides it (16 for 80, 64 for 192), still orthogonal and symmetric; one below
MIN_BLOCK spreads too little to be worth it and is refused.

Presses that score the rotated keys see the same dot products and norms (KNorm, SnapKV, TOVA,
ObservedAttention, a cosine to the mean key); a press that reads key channels one by one (through
RoPE frequencies, Press.reads_channels: Expected Attention) would not, and CacheConfig refuses it with a rotation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

ROTATIONS = ("hadamard",)
MIN_BLOCK = 8


def hadamard_block(width: int) -> int:
  """The block of the block-diagonal Hadamard over `width`: its largest power-of-two divisor."""
  return width & -width


def check_width(width: int, what: str) -> None:
  """Raises ValueError unless vectors of `width` can be rotated (`what` names them)."""
  if hadamard_block(width) < MIN_BLOCK:
    raise ValueError(
      f"CacheConfig.rotation='hadamard' rotates blocks of the largest power of two dividing the head "
      f"width, at least {MIN_BLOCK}; {what} is {width} wide (block {hadamard_block(width)})"
    )


@functools.cache
def hadamard(width: int) -> np.ndarray:
  """float32 [width, width]: the normalized (block) Walsh-Hadamard matrix, symmetric and orthogonal."""
  block = hadamard_block(width)
  h = np.ones((1, 1))
  while h.shape[0] < block:  # Sylvester: H_2n = [[H, H], [H, -H]]
    h = np.block([[h, h], [h, -h]])
  return np.kron(np.eye(width // block), h / np.sqrt(block)).astype(np.float32)


def rotate(x: jax.Array) -> jax.Array:
  """x [..., W] -> R x along the last axis, in float32 and back to x's dtype. R is its own
  inverse, so the same call turns a rotated vector back."""
  r = jnp.asarray(hadamard(x.shape[-1]))
  return jnp.matmul(x.astype(jnp.float32), r, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
