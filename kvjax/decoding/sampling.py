"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus).

All settings are traced values, so changing them does not recompile a jitted decode loop.
temperature == 0 is greedy; top_k == 0 and top_p == 1 disable those filters.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Sampling:
  temperature: jax.Array | float = 0.0
  top_k: jax.Array | int = 0
  top_p: jax.Array | float = 1.0

  @classmethod
  def create(cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None):
    """Checks the settings and returns them as arrays (so jit traces rather than specialises)."""
    if not temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
      raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    return cls(jnp.float32(temperature), jnp.int32(top_k or 0), jnp.float32(1.0 if top_p is None else top_p))


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Sets logits outside the top-k and outside the top-p nucleus to -inf. logits [B, V]."""
  vocab = logits.shape[-1]
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending [B, V]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_logits, jnp.broadcast_to(k - 1, (logits.shape[0], 1)), axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Keep a token while the mass strictly before it is < top_p, so the top token always survives.
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  nucleus = jnp.where(mass_before < top_p, sorted_logits, jnp.inf).min(axis=-1, keepdims=True)
  threshold = jnp.maximum(kth, nucleus)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
  """logits float[B, V] -> token ids int32[B]."""

  def draw(_):
    scaled = logits / jnp.maximum(sampling.temperature, 1e-6)
    return jax.random.categorical(rng, filter_logits(scaled, sampling.top_k, sampling.top_p)).astype(jnp.int32)

  greedy = lambda _: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(sampling.temperature > 0, draw, greedy, None)
