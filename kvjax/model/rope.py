"""Rotary position embedding (RoPE): the one frequency function, and the rotation every attention
kind applies (kvjax.model.attention's K/V heads, kvjax.model.mla's shared rotary keys).

Rotate-half convention (Llama, GPT-NeoX, and so every Hugging Face checkpoint kvjax reads): a head
of W rotary dims is W/2 pairs, dims j and j + W/2, and pair j turns by position x freq[j] radians.

Frequencies are computed on the host in float64 and rounded once to float32: they are constants of
the config, so jit folds them in, and every path that rotates (training, prefill, decode, MLA's
absorbed read, a converted model's kept pairs) turns by the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import RopeScaling


def llama3_scaled(freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
  """Llama 3.1's frequency scaling (transformers' `_compute_llama3_parameters`).

  A pair whose wavelength 2 pi / f is short next to the pretraining context (below
  original_max_position / high_freq_factor) turned many times within it and keeps its frequency;
  one whose wavelength is long (above original_max_position / low_freq_factor) is slowed by
  `factor`, so the longer context maps into the angles pretraining saw; in between the two blend,
  (1 - s) f / factor + s f with s = (original_max_position / wavelength - low) / (high - low).
  Clipping s to [0, 1] gives the two outer rules as well.

  Args:
    freq: float64 [W/2], the unscaled frequencies (radians per position).
  Returns:
    float64 [W/2].
  """
  turns = scaling.original_max_position * freq / (2 * np.pi)  # original context / wavelength
  s = (turns - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
  s = np.clip(s, 0.0, 1.0)
  return (1 - s) * freq / scaling.factor + s * freq


# RopeScaling.kind -> its rule; adding a scaling is one entry here and one in config.ROPE_SCALINGS.
SCALINGS: dict[str, Callable[[np.ndarray, RopeScaling], np.ndarray]] = {"llama3": llama3_scaled}


@functools.lru_cache(maxsize=64)  # every layer of a model traces the same table
def frequencies(theta: float, dims: int, scaling: RopeScaling | None = None) -> np.ndarray:
  """The frequency of each rotate-half pair of a RoPE head `dims` wide.

  Pair j turns by theta^(-2j / dims) radians per position (ModelConfig.rope_theta), rescaled by
  `scaling` (ModelConfig.rope_scaling) when given.

  Args:
    theta: the RoPE base, > 0.
    dims: rotary dims of the head, even.
    scaling: None for plain RoPE.
  Returns:
    float32 numpy [dims / 2], read-only (shared between calls).
  """
  if isinstance(dims, bool) or not isinstance(dims, (int, np.integer)) or dims < 2 or dims % 2:
    raise ValueError(f"RoPE frequencies need a positive even number of dims (rotate-half pairs), got dims={dims!r}")
  half = dims // 2
  freq = float(theta) ** (-np.arange(half, dtype=np.float64) / half)
  if scaling is not None:
    freq = SCALINGS[scaling.kind](freq, scaling)
  freq = freq.astype(np.float32)
  freq.flags.writeable = False
  return freq


def apply_rope(x: jax.Array, positions: jax.Array, freq: np.ndarray | jax.Array) -> jax.Array:
  """Rotates x by RoPE (rotate-half), in float32.

  Args:
    x: [B, T, heads, W].
    positions: int[B, T], the position of each token.
    freq: [W/2], the same for every head (`frequencies`), or [heads, W/2], per head (MLA's
      groups, whose kept pairs differ).
  Returns:
    [B, T, heads, W] in x's dtype.
  """
  angle = positions[:, :, None, None].astype(jnp.float32) * jnp.asarray(freq, jnp.float32)  # [B, T, 1 or heads, W/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
  """One layer's RoPE as a value (its base, rotary dims and scaling), handed with the layer's
  queries to whatever needs to turn vectors as the layer does: a press that undoes the rotation of
  the prompt's queries or carries them to future positions (kvjax.cache.presses)."""

  theta: float
  dims: int
  scaling: RopeScaling | None = None

  @property
  def freq(self) -> np.ndarray:
    """float32 [dims / 2]: each rotate-half pair's radians per position."""
    return frequencies(self.theta, self.dims, self.scaling)

  def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, heads, dims] turned to positions int[B, T] (negative positions undo a turn)."""
    return apply_rope(x, positions, self.freq)
