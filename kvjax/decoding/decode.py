"""Jitted prefill, decode_step and generate over the preallocated KV cache.

The cache is the Flax 'cache' collection: {'layers_{i}': {'attn': {'k', 'v'}}, 'lengths'},
with k [B, K, H, max_len] and v [B, K, max_len, H] in config.cache_dtype (see kvjax.model.attention) and lengths int32[B] (tokens written per row).
Every function returns a new cache; the one passed in is donated and must not be reused.
Given a `mesh`, each places params, batch rows and cache by kvjax.sharding's rules, and XLA
partitions the same computation over it.

Inputs are checked on the host before any compute: lax.dynamic_update_slice clamps an
out-of-range write silently, so an overflowing cache must never reach the device.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import sharding
from kvjax.model.attention import CACHE_SEQ_AXIS
from kvjax.model.transformer import Transformer
from kvjax.decoding.sampling import Sampling, sample

Cache = dict


def check_prompts(model: Transformer, tokens, lengths, max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Validates right-padded prompts; returns them as int32 numpy arrays with padding set to 0."""
  cfg = model.config
  tokens = np.asarray(tokens)
  lengths = np.asarray(lengths)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be an integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
  batch, seq = tokens.shape
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"lengths must be an integer array of shape ({batch},) to match tokens, "
                     f"got {lengths.dtype}{list(lengths.shape)}")
  if seq == 0 or (lengths < 1).any():
    row = int(np.argmin(lengths)) if batch and seq else 0
    raise ValueError(f"empty prompt: row {row} has length {int(lengths[row]) if batch else 0}; "
                     "every prompt needs at least one token")
  if (lengths > seq).any():
    row = int(np.argmax(lengths))
    raise ValueError(f"lengths[{row}]={int(lengths[row])} exceeds the {seq} tokens given")
  if not 0 < max_len <= cfg.max_len:
    raise ValueError(f"cache length max_len={max_len} must be in [1, ModelConfig.max_len={cfg.max_len}]")
  if seq > max_len:
    raise ValueError(f"prompt of {seq} tokens does not fit the cache length max_len={max_len}")
  valid = np.arange(seq)[None, :] < lengths[:, None]
  bad = valid & ((tokens < 0) | (tokens >= cfg.vocab_size))
  if bad.any():
    row, pos = map(int, np.argwhere(bad)[0])
    raise ValueError(f"token id {int(tokens[row, pos])} at row {row}, position {pos} is outside "
                     f"[0, vocab_size={cfg.vocab_size})")
  return np.where(valid, tokens, 0).astype(np.int32), lengths.astype(np.int32)


def check_step_tokens(model: Transformer, tokens, lengths: np.ndarray) -> np.ndarray:
  """Validates one decode step's tokens (one per row, ids in the vocabulary) -> numpy array."""
  tokens = np.asarray(tokens)
  if tokens.shape != lengths.shape or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be an integer array of shape {lengths.shape} (one per row), "
                     f"got {tokens.dtype}{list(tokens.shape)}")
  bad = (tokens < 0) | (tokens >= model.config.vocab_size)
  if bad.any():
    row = int(np.argmax(bad))
    raise ValueError(f"token id {int(tokens[row])} at row {row} is outside "
                     f"[0, vocab_size={model.config.vocab_size})")
  return tokens


@functools.partial(jax.jit, static_argnames=("model", "max_len", "last_only"))
def _prefill(model, params, tokens, lengths, max_len, last_only=False):
  logits, variables = model.apply({"params": params}, tokens, lengths, max_len, last_only,
                                  method=Transformer.prefill, mutable=["cache"])
  return logits, variables["cache"]


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _decode_step(model, params, cache, tokens):
  logits, variables = model.apply({"params": params, "cache": cache}, tokens,
                                  method=Transformer.decode, mutable=["cache"])
  return logits, variables["cache"]


def cache_capacity(cache: Cache) -> int:
  """max_len of a cache: the length of its buffers' sequence axis."""
  return cache["layers_0"]["attn"]["v"].shape[CACHE_SEQ_AXIS["v"]]


def cache_bytes(cache: Cache) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(cache))


def prefill(model: Transformer, params, tokens, lengths, max_len: int, *, last_only: bool = False,
            mesh=None):
  """Runs right-padded prompts through the model and fills a new cache.

  Args:
    tokens: int[B, T], row b holds its prompt in [0, lengths[b]).
    lengths: int[B], each in [1, T].
    max_len: cache length S; decoding can continue while lengths < S.
    last_only: return only each row's next-token logits (skips the vocabulary projection of
      every other position, and the last layer's attention output and MLP there).
  Returns:
    (logits float32[B, T, V], cache). The next-token logits of row b are logits[b, lengths[b] - 1];
    with last_only, (logits float32[B, V] holding those, cache).
  """
  tokens, lengths = check_prompts(model, tokens, lengths, max_len)
  params, (tokens, lengths) = sharding.place(mesh, params, tokens, lengths)
  return _prefill(model, params, tokens, lengths, max_len, last_only)


def decode_step(model: Transformer, params, cache: Cache, tokens, *, mesh=None):
  """Feeds one token per row at position cache['lengths'][b] -> (logits float32[B, V], new cache)."""
  lengths = np.asarray(cache["lengths"])
  tokens = check_step_tokens(model, tokens, lengths)
  capacity = cache_capacity(cache)
  if (lengths >= capacity).any():
    row = int(np.argmax(lengths))
    raise ValueError(f"cache is full: row {row} holds {int(lengths[row])} tokens and the cache length "
                     f"is {capacity}; prefill with a larger max_len")
  params, (tokens,) = sharding.place(mesh, params, tokens.astype(np.int32))
  if mesh is not None:
    cache = jax.device_put(cache, sharding.cache_sharding(cache, mesh))
  return _decode_step(model, params, cache, jnp.asarray(tokens))


@flax.struct.dataclass
class DecodeState:
  step: jax.Array  # int32: tokens generated so far
  last: jax.Array  # int32[B]: the token to feed next
  done: jax.Array  # bool[B]: row has produced eos_id
  tokens: jax.Array  # int32[B, max_new_tokens]
  cache: Cache
  rng: jax.Array


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "max_len"))
def _generate(model, params, prompts, lengths, rng, sampling, eos_id, max_new_tokens, max_len):
  batch = prompts.shape[0]
  logits, cache = _prefill(model, params, prompts, lengths, max_len, last_only=True)
  rng, key = jax.random.split(rng)
  first = sample(logits, key, sampling)
  state = DecodeState(
      step=jnp.int32(1), last=first, done=first == eos_id,
      tokens=jnp.full((batch, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(first),
      cache=cache, rng=rng)

  def cond(s: DecodeState):
    return (s.step < max_new_tokens) & ~s.done.all()

  def body(s: DecodeState):
    logits, variables = model.apply({"params": params, "cache": s.cache}, s.last,
                                    method=Transformer.decode, mutable=["cache"])
    rng, key = jax.random.split(s.rng)
    token = jnp.where(s.done, eos_id, sample(logits, key, sampling))
    return DecodeState(step=s.step + 1, last=token, done=s.done | (token == eos_id),
                       tokens=jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step)),
                       cache=variables["cache"], rng=rng)

  return jax.lax.while_loop(cond, body, state).tokens


def size_bucket(n: int, limit: int, floor: int = 16) -> int:
  """n rounded up to a power of two (at least floor, at most limit, never below n): padding sizes
  to buckets makes jitted functions compile once per bucket rather than once per size."""
  return max(min(max(floor, 1 << (n - 1).bit_length()), limit), n)


def generate(model: Transformer, params, prompts, lengths, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, rng: jax.Array | None = None, mesh=None) -> jax.Array:
  """Prefill, then the whole decode loop in one jitted lax.while_loop.

  Args:
    prompts: int[B, T] right-padded; lengths: int[B].
    max_new_tokens: tokens to generate per row (the first comes from the prefill logits).
    temperature: 0 is greedy; top_k / top_p filter before sampling.
    eos_id: a row stops after producing it; later positions hold eos_id. The loop ends when
      every row has stopped.
  Returns:
    int32[B, max_new_tokens].
  Compiles once per (batch, prompt bucket, max_new_tokens); sampling settings are traced.
  """
  cfg = model.config
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  longest = int(np.max(lengths)) if np.size(lengths) else 0
  if longest + max_new_tokens - 1 > cfg.max_len:
    raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} needs "
                     f"{longest + max_new_tokens - 1} cache positions, more than ModelConfig.max_len={cfg.max_len}")
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    raise ValueError(f"eos_id={eos_id} is outside [0, vocab_size={cfg.vocab_size})")
  sampling = Sampling.create(temperature, top_k, top_p)
  prompts, lengths = check_prompts(model, prompts, lengths, cfg.max_len)
  bucket = size_bucket(longest, cfg.max_len - max_new_tokens + 1)
  padded = np.zeros((prompts.shape[0], bucket), np.int32)
  padded[:, :longest] = prompts[:, :longest]
  max_len = bucket + max_new_tokens - 1
  rng = jax.random.key(0) if rng is None else rng
  params, (padded, lengths) = sharding.place(mesh, params, padded, lengths)
  return _generate(model, params, padded, lengths, rng, sampling,
                   jnp.int32(-1 if eos_id is None else eos_id), max_new_tokens, max_len)
