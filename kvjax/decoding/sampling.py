"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus).

`Sampling` is the one value that says how to sample: generate, stream, kvjax generate's
continue_text and the engine's requests take it (`sampling=Sampling(temperature=0.8, top_p=0.9)`).
temperature == 0 is greedy; top_k == 0 and top_p == 1 disable those filters. The decode loops hold
the settings as traced arrays (`arrays`), so changing them does not recompile a jitted loop.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.fields import INT32_MAX


@flax.struct.dataclass
class Sampling:
  """temperature (>= 0; 0 is greedy), top_k (0: off; else sample among the k likeliest tokens),
  top_p (in (0, 1]; 1: off; else within that probability mass). Each is a Python number as a user
  writes it, checked here, or an array: the traced form (`arrays`, or the engine's [B] rows),
  which jax rebuilds from a pytree's leaves and which is not checked again."""

  temperature: jax.Array | float = 0.0
  top_k: jax.Array | int = 0
  top_p: jax.Array | float = 1.0

  def __post_init__(self):
    def number(value):
      return isinstance(value, (bool, int, float))

    if number(self.temperature) and (
      isinstance(self.temperature, bool) or not (math.isfinite(self.temperature) and self.temperature >= 0)
    ):
      raise ValueError(f"Sampling.temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
    if number(self.top_k) and (isinstance(self.top_k, (bool, float)) or not 0 <= self.top_k <= INT32_MAX):
      raise ValueError(f"Sampling.top_k must be an integer >= 0 (0: no top-k filter), got {self.top_k!r}")
    if number(self.top_p) and (isinstance(self.top_p, bool) or not 0 < self.top_p <= 1):
      raise ValueError(f"Sampling.top_p must be in (0, 1] (1: no nucleus filter), got {self.top_p!r}")

  @classmethod
  def create(cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> "Sampling":
    """The settings as the command line gives them (None: that filter off; top_k, when given, at
    least 1), checked and as arrays."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
      raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    return cls(temperature, top_k or 0, 1.0 if top_p is None else top_p).arrays()

  def arrays(self) -> "Sampling":
    """The settings as float32 / int32 arrays: what a jitted loop traces, so that other values
    reuse its compilation."""
    return Sampling(jnp.float32(self.temperature), jnp.int32(self.top_k), jnp.float32(self.top_p))


def check_sampling(sampling) -> Sampling:
  """`sampling` as arrays; ValueError unless it is a Sampling."""
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a kvjax.Sampling, got {sampling!r}")
  return sampling.arrays()


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
