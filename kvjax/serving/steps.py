"""The engine's device calls (kvjax.serving.engine): one request's prefill or extension into its
pages, the decode step of every row, and the per-row sampler, each jitted once per shape; and the
host-side padding of a context to its prompt bucket, which bounds those shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decoding.decode import forward, size_bucket
from kvjax.decoding.sampling import Sampling, sample

MIN_PROMPT_BUCKET = 16


@jax.jit
def pick(logits, sampling: Sampling, seed, ids, index):
  """Per-row sampling: logits [B, V], settings [B], token index [B] -> int32[B]. Jitted apart from the
  model so that the sampler compiles once per batch size, not once per prompt bucket or width.
  Rows are sampled under vmap, where each row's own greedy-or-sample choice becomes a select that
  computes both (a sort of the vocabulary per row): a batch of greedy rows takes the argmax alone."""

  def draw(_):
    base = jax.random.key(seed)
    keys = jax.vmap(lambda i, t: jax.random.fold_in(jax.random.fold_in(base, i), t))(ids, index)
    return jax.vmap(lambda row, key, s: sample(row[None], key, s)[0])(logits, keys, sampling)

  greedy = lambda _: jnp.argmax(logits, axis=-1).astype(jnp.int32)  # noqa: E731
  return jax.lax.cond(jnp.any(sampling.temperature > 0), draw, greedy, None)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def prefill(model, params, cache, tokens, lengths):
  """One request's context into its (empty) pages -> (next-token logits [1, V], cache)."""
  return forward(model, params, cache, tokens, lengths, last=True, from_empty=True)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def extend(model, params, cache, tokens, lengths):
  """More of one request's context after what its pages hold -> (next-token logits [1, V], cache)."""
  return forward(model, params, cache, tokens, lengths, last=True)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def decode(model, params, cache, tokens):
  """One token for every row -> (logits [B, V], cache)."""
  logits, cache = forward(model, params, cache, tokens[:, None], jnp.ones_like(tokens))
  return logits[:, 0], cache


def stack_sampling(settings: list[tuple[float, int, float]]) -> Sampling:
  """Per-row sampling settings as one Sampling of [B] arrays."""
  temperature, top_k, top_p = zip(*settings)
  return Sampling(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))


def padded(tokens: np.ndarray, max_len: int, columns: int = 0) -> np.ndarray:
  """tokens int[L] right-padded to the prompt bucket of L (of `columns`, when more) -> int32[1, bucket]."""
  out = np.zeros((1, size_bucket(max(tokens.size, columns), max_len, MIN_PROMPT_BUCKET)), np.int32)
  out[0, : tokens.size] = tokens
  return out
