"""prefill, extend, decode_step and generate: jitted decoding over any cache kind.

All four run the model's one forward pass (kvjax.model.transformer) on a cache (kvjax.cache):
prefill starts a contiguous cache from right-padded prompts, extend appends a right-padded chunk
after what each row holds (a long prompt in pieces, the next turn of a conversation), decode_step
appends one token per row, and generate runs prefill then the whole decode loop in one
lax.while_loop. Every function returns a new cache; the one passed in is donated and must not
be reused.

Inputs are checked on the host before any compute (the cache kind checks that the new tokens fit:
lax.dynamic_update_slice clamps an out-of-range write silently). These are the entry points
that choose how the model's products run: on a single CPU device they route them to kvjax's CPU
kernels (built before tracing; without a compiler kvjax warns once and uses XLA). Given a
`mesh`, each places params, batch rows and cache by kvjax.sharding's rules, and XLA partitions
the same computation over it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory, sharding
from kvjax.cache.base import KVCache, size_bucket
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.fields import check_positive_int
from kvjax.decoding.sampling import Sampling, check_sampling, sample
from kvjax.kernels import attention as attention_kernel
from kvjax.kernels import build, matmul
from kvjax.model.backend import XLA, Backend, xla_cache_attention, xla_matmul, xla_prompt_attention
from kvjax.model.transformer import Transformer, apply_cached

LOGITS = ("all", "last")


@functools.cache
def cpu_backend() -> Backend:
  """The CPU kernels that built (building them on first call), as a backend."""
  return Backend(
    matmul=matmul.matmul if build.available("matmul") else xla_matmul,
    cache_attention=(attention_kernel.cache_attention if build.available("attention") else xla_cache_attention),
    prompt_attention=(attention_kernel.prompt_attention if build.available("attention") else xla_prompt_attention),
  )


def for_decoding(model: Transformer, mesh=None) -> Transformer:
  """`model` with the CPU kernels' backend on a single CPU device without a mesh; otherwise (or
  when the model already has a backend of its own) unchanged."""
  if mesh is not None or model.backend is not XLA or not build.single_cpu():
    return model
  backend = cpu_backend()
  return model if backend == XLA else model.clone(backend=backend)


def check_tokens(model: Transformer, tokens, lengths, *, min_length: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Validates right-padded tokens int[B, T] with lengths int[B] in [min_length, T]; returns them
  as int32 numpy arrays with the padding set to 0."""
  cfg = model.config
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be an integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
  batch, seq = tokens.shape
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(
      f"lengths must be an integer array of shape ({batch},) to match tokens, got {lengths.dtype}{list(lengths.shape)}"
    )
  if batch == 0 or seq == 0:
    raise ValueError(f"tokens must hold at least one row and one column, got shape {list(tokens.shape)}")
  if (lengths < min_length).any():
    row = int(np.argmin(lengths))
    what = "empty prompt" if min_length else "negative length"
    raise ValueError(
      f"{what}: row {row} has length {int(lengths[row])}; every row needs at least "
      f"{min_length} token{'s' if min_length != 1 else ''}"
    )
  if (lengths > seq).any():
    row = int(np.argmax(lengths))
    raise ValueError(f"lengths[{row}]={int(lengths[row])} exceeds the {seq} tokens given")
  valid = np.arange(seq)[None, :] < lengths[:, None]
  bad = valid & ((tokens < 0) | (tokens >= cfg.vocab_size))
  if bad.any():
    row, pos = map(int, np.argwhere(bad)[0])
    raise ValueError(
      f"token id {int(tokens[row, pos])} at row {row}, position {pos} is outside [0, vocab_size={cfg.vocab_size})"
    )
  return np.where(valid, tokens, 0).astype(np.int32), lengths.astype(np.int32)


def check_cache(model: Transformer, cache, new_lengths: np.ndarray) -> None:
  """Host-side checks before any compute: `cache` is a cache kind made for this model, every row
  can take its new tokens, and no position passes ModelConfig.max_positions."""
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a kvjax cache (ContiguousCache, PagedCache, ...), got {type(cache).__name__}")
  if new_lengths.shape[0] != cache.lengths.shape[0]:
    raise ValueError(f"tokens have {new_lengths.shape[0]} rows but the cache has {cache.lengths.shape[0]}")
  cache.check_model(model.config)
  cache.check_room(new_lengths)
  ends = np.asarray(cache.lengths) + new_lengths
  row = int(np.argmax(ends))
  cache.model_config(model.config).check_length(int(ends[row]), f"row {row} would hold {int(ends[row])} tokens")


def forward(
  model: Transformer, params, cache: KVCache, tokens, lengths, *, last: bool = False, from_empty: bool = False
):
  """Traced body of every decode function: tokens int32[B, T] with lengths int32[B] written after
  what the cache holds -> (logits float32 [B, T, V], or [B, V] at each row's last new token when
  `last`; the new cache). A first call is the cache's own when it has one (KVCache.first_call: a
  model-level press, KVzip's)."""
  logits_at = jnp.maximum(lengths - 1, 0)[:, None] if last else None
  hooked = cache.first_call(model, params, tokens, lengths, logits_at) if from_empty else None
  if hooked is not None:
    logits, new = hooked
    return (logits[:, 0] if last else logits), new
  logits, layers = apply_cached(model, params, cache, tokens, lengths, logits_at, from_empty)
  new = cache.replace(layers=layers, lengths=cache.lengths + lengths)
  return (logits[:, 0] if last else logits), new


_forward = jax.jit(forward, static_argnames=("model", "last", "from_empty"), donate_argnames=("cache",))


def compilations() -> int:
  """The compiled forward calls (prefill, extend, decode step; one per shape and cache kind) this
  process holds."""
  return _forward._cache_size()


def _place(mesh, params, cache, *batch):
  params, batch = sharding.place(mesh, params, *batch)
  if mesh is not None:
    cache = jax.device_put(cache, sharding.cache_sharding(cache, mesh))
  return params, cache, batch


def extend(model: Transformer, params, cache: KVCache, tokens, lengths, *, logits: str = "all", mesh=None):
  """Appends a right-padded chunk after what each row of `cache` holds.

  Args:
    cache: any cache kind (donated).
    tokens: int[B, T], row b's new tokens in [0, lengths[b]).
    lengths: int[B], each in [0, T] (a row may take no tokens); with logits="last", in [1, T].
    logits: "all" -> float32[B, T, V] (row b's next-token logits at [b, lengths[b] - 1]);
      "last" -> float32[B, V], only those (the rest of the last layer is not computed).
  The chunk runs padded to a bucket's width (compiling once per bucket); the logits are cut back
  to T columns.
  Returns:
    (logits, the new cache holding lengths[b] more tokens per row).
  Raises ValueError, naming the row, if a row's tokens do not fit the cache.
  """
  if logits not in LOGITS:
    raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
  tokens, lengths = check_tokens(model, tokens, lengths, min_length=1 if logits == "last" else 0)
  check_cache(model, cache, lengths)
  return _run(model, params, cache, tokens, lengths, logits == "last", mesh)


def _run(model: Transformer, params, cache: KVCache, tokens: np.ndarray, lengths: np.ndarray, last: bool, mesh):
  """`extend` on checked inputs (with `last`, a row of no tokens gets its logits at column 0)."""
  held = np.asarray(cache.lengths)
  # The chunk padded to a bucket, its padding columns' positions kept inside the model's (a learned
  # position table has no row past them).
  width = tokens.shape[1]
  room = cache.model_config(model.config).max_positions - int(held.max())
  padded = np.zeros((tokens.shape[0], size_bucket(width, max(room, width))), np.int32)
  padded[:, :width] = tokens
  params, cache, (padded, lengths) = _place(mesh, params, cache, padded, lengths)
  out, cache = _forward(
    for_decoding(model, mesh),
    params,
    cache,
    jnp.asarray(padded),
    jnp.asarray(lengths),
    last=last,
    from_empty=not held.any(),
  )
  if not last and out.shape[1] != width:
    # Cut on the host: a slice on the device would compile once per width.
    out = jax.device_put(np.asarray(out)[:, :width], out.sharding)
  return out, cache


def prefill(
  model: Transformer,
  params,
  tokens,
  lengths,
  max_len: int,
  *,
  logits: str = "all",
  mesh=None,
  cache_config: CacheConfig = CacheConfig(),
):
  """Runs right-padded prompts through the model into a new cache of `cache_config` (default:
  contiguous, in the model's dtype) of max_len positions per row (at most
  ModelConfig.max_positions): `extend` on an empty cache (kvjax.cache.kinds.create). The cache's
  storage is a bucket's (max_len rounded up to the ladder of kvjax.cache.base.size_bucket), so prefills of nearby lengths
  share compiled functions; it takes max_len positions all the same and refuses more
  (KVCache.limit).

  tokens int[B, T], lengths int[B] each in [1, T]; see `extend` for `logits`.
  """
  check_positive_int(max_len, "max_len")
  tokens, lengths = check_tokens(model, tokens, lengths)
  cache_config.model(model.config).check_length(max_len, f"cache length max_len={max_len}")
  if tokens.shape[1] > max_len:
    raise ValueError(f"prompt of {tokens.shape[1]} tokens does not fit the cache length max_len={max_len}")
  cache = kinds.create(model.config, cache_config, tokens.shape[0], max_len, prompt=tokens.shape[1], bucket=True)
  chunk = cache_config.prefill_chunk
  if not chunk or tokens.shape[1] <= chunk:
    return extend(model, params, cache, tokens, lengths, logits=logits, mesh=mesh)
  if logits not in LOGITS:
    raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
  outs = []
  for start in range(0, tokens.shape[1], chunk):  # each chunk pressed into the budget as it arrives
    part = np.clip(lengths - start, 0, chunk).astype(np.int32)
    check_cache(model, cache, part)
    out, cache = _run(model, params, cache, tokens[:, start : start + chunk], part, logits == "last", mesh)
    outs.append((part, np.asarray(out)))
  if logits == "all":
    return jnp.asarray(np.concatenate([out for _, out in outs], axis=1)), cache
  last = outs[0][1]
  for part, out in outs[1:]:
    last = np.where((part > 0)[:, None], out, last)  # each row's logits from the chunk holding its last token
  return jnp.asarray(last), cache


def decode_step(model: Transformer, params, cache: KVCache, tokens, *, mesh=None):
  """Feeds one token per row at position cache.lengths[b] -> (logits float32[B, V], new cache)."""
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a kvjax cache (ContiguousCache, PagedCache, ...), got {type(cache).__name__}")
  tokens = np.asarray(tokens)
  batch = cache.lengths.shape[0]
  if tokens.shape != (batch,) or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(
      f"tokens must be an integer array of shape ({batch},) (one per row), got {tokens.dtype}{list(tokens.shape)}"
    )
  bad = (tokens < 0) | (tokens >= model.config.vocab_size)
  if bad.any():
    row = int(np.argmax(bad))
    raise ValueError(f"token id {int(tokens[row])} at row {row} is outside [0, vocab_size={model.config.vocab_size})")
  ones = np.ones((batch,), np.int32)
  check_cache(model, cache, ones)
  params, cache, (tokens, ones) = _place(mesh, params, cache, tokens.astype(np.int32), ones)
  return _forward(for_decoding(model, mesh), params, cache, jnp.asarray(tokens)[:, None], jnp.asarray(ones), last=True)


@flax.struct.dataclass
class DecodeState:
  step: jax.Array  # int32: tokens generated so far
  last: jax.Array  # int32[B]: the token to feed next
  done: jax.Array  # bool[B]: row has produced a stop token
  tokens: jax.Array  # int32[B, max_new_tokens]
  cache: KVCache
  rng: jax.Array


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "max_len", "cache_config"))
def _generate(model, params, prompts, lengths, rng, sampling, stop_ids, max_new_tokens, max_len, cache_config):
  batch = prompts.shape[0]
  cache = kinds.create(model.config, cache_config, batch, max_len, prompt=prompts.shape[1])
  chunk = cache_config.prefill_chunk or prompts.shape[1]
  logits, cache = forward(
    model, params, cache, prompts[:, :chunk], jnp.minimum(lengths, chunk), last=True, from_empty=True
  )
  for start in range(chunk, prompts.shape[1], chunk):  # each chunk pressed into the budget as it arrives
    part = jnp.clip(lengths - start, 0, chunk)
    out, cache = forward(model, params, cache, prompts[:, start : start + chunk], part, last=True)
    logits = jnp.where((part > 0)[:, None], out, logits)
  rng, key = jax.random.split(rng)
  first = sample(logits, key, sampling)
  state = DecodeState(
    step=jnp.int32(1),
    last=first,
    done=jnp.isin(first, stop_ids),
    tokens=jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first),
    cache=cache,
    rng=rng,
  )
  ones = jnp.ones((batch,), jnp.int32)

  def cond(s: DecodeState):
    return (s.step < max_new_tokens) & ~s.done.all()

  def body(s: DecodeState):
    logits, cache = forward(model, params, s.cache, s.last[:, None], ones)
    rng, key = jax.random.split(s.rng)
    token = jnp.where(s.done, s.last, sample(logits[:, 0], key, sampling))  # a stopped row repeats its stop
    return DecodeState(
      step=s.step + 1,
      last=token,
      done=s.done | jnp.isin(token, stop_ids),
      tokens=jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step)),
      cache=cache,
      rng=rng,
    )

  tokens = jax.lax.while_loop(cond, body, state).tokens  # -1 past the step where every row had stopped
  is_stop = jnp.isin(tokens, stop_ids)
  first_stop = jnp.argmax(is_stop, axis=1)[:, None]
  after = is_stop.any(axis=1, keepdims=True) & (jnp.arange(max_new_tokens)[None, :] > first_stop)
  return jnp.where(after, jnp.take_along_axis(tokens, first_stop, axis=1), tokens)


def generate(
  model: Transformer,
  params,
  prompts,
  lengths,
  max_new_tokens: int,
  *,
  sampling: Sampling = Sampling(),
  stop_ids: Sequence[int] | int = (),
  rng: jax.Array | None = None,
  mesh=None,
  cache_config: CacheConfig = CacheConfig(),
) -> jax.Array:
  """Prefill, then the whole decode loop in one jitted lax.while_loop.

  Args:
    prompts: int[B, T] right-padded; lengths: int[B].
    max_new_tokens: tokens to generate per row (the first comes from the prefill logits).
    sampling: how each token is drawn (kvjax.decoding.sampling.Sampling; the default is greedy).
    stop_ids: a row stops after producing any of these token ids (a tokenizer's eos and
      end-of-turn tokens, kvjax.interop.tokenizer.TextTokenizer.stop_ids); its later positions
      repeat that stop token (`until_stop` cuts them). The loop ends when every row has stopped.
    cache_config: the KV cache's layout, codec and windows (kvjax.cache.config).
  Returns:
    int32[B, max_new_tokens].
  Compiles once per (batch, prompt bucket, max_new_tokens); sampling settings are traced.
  """
  cfg = cache_config.model(model.config)
  check_positive_int(max_new_tokens, "max_new_tokens")
  prompts, lengths = check_tokens(model, prompts, lengths)
  longest = int(lengths.max())
  cfg.check_length(
    longest + max_new_tokens - 1,
    f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} "
    f"needs {longest + max_new_tokens - 1} cache positions",
  )
  stop_ids = check_stop_ids(stop_ids, cfg.vocab_size)
  sampling = check_sampling(sampling)
  bucket = size_bucket(longest, cfg.max_positions - max_new_tokens + 1)
  padded = np.zeros((prompts.shape[0], bucket), np.int32)
  padded[:, :longest] = prompts[:, :longest]
  max_len = bucket + max_new_tokens - 1
  memory.check_fits(
    "generation",
    {
      "KV cache": kinds.cache_bytes(model.config, cache_config, prompts.shape[0], max_len, prompt=bucket),
      "prefill": memory.forward_bytes(
        cfg, prompts.shape[0], min(bucket, cache_config.prefill_chunk or bucket), logits=1
      ),
    },
    devices=None if mesh is None else list(mesh.devices.flat),
  )
  rng = jax.random.key(0) if rng is None else rng
  params, (padded, lengths) = sharding.place(mesh, params, padded, lengths)
  return _generate(
    for_decoding(model, mesh),
    params,
    padded,
    lengths,
    rng,
    sampling,
    jnp.asarray(stop_ids, jnp.int32),
    max_new_tokens,
    max_len,
    cache_config,
  )


def check_stop_ids(stop_ids: Sequence[int] | int, vocab_size: int) -> tuple[int, ...]:
  """Stop token ids as a sorted tuple of distinct ints in [0, vocab_size) (one int is one id);
  ValueError naming the first id outside the vocabulary."""
  ids = (stop_ids,) if isinstance(stop_ids, (int, np.integer)) else tuple(stop_ids)
  for token in ids:
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab_size:
      raise ValueError(f"stop token id {token!r} is outside [0, vocab_size={vocab_size})")
  return tuple(sorted({int(t) for t in ids}))


def until_stop(tokens, stop_ids: Sequence[int]) -> list[np.ndarray]:
  """Each row of generated tokens int[B, N] up to and without its first stop token."""
  stops = np.asarray(list(stop_ids), np.int64)
  rows = []
  for row in np.asarray(tokens):
    hits = np.flatnonzero(np.isin(row, stops))
    rows.append(row[: hits[0]] if hits.size else row)
  return rows
