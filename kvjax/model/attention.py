"""Grouped-query attention: one code path for MHA, GQA and MQA, whatever the cache.

Einsum alphabet, used across kvjax:
  B batch, T query length, S key length, D model dim, N query heads = K * G,
  K kv heads, G query heads per kv head (q_per_kv), H head dim, F MLP hidden, V vocab.

Query head n reads kv head n // G (contiguous groups); `kv_head_of` is that rule, and
everything that groups heads (attention, conversion, sharding) goes through it.

Attention projects queries and this call's keys and values, then hands them to the cache kind
it is given (kvjax.cache) as a payload: the arrays it declares per token (`Field`; {k, v} here,
{latent, rope_key} for MLA, kvjax.model.mla) and a query object that knows how to read them. The
kind stores what it keeps in the Flax 'cache' collection and hands the query what it reads.
`NoCache`, the kind of a plain forward pass (training, evaluation), keeps nothing.

Which keys a query reads is decided in one place, `visible`: causal, and within a windowed
layer's sliding window and sinks (`Window`). Each Attention puts its layer's window, as the cache
kind gives it, on the Span (`span.window`), so every kind masks alike.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.config import ModelConfig
from kvjax.model.backend import XLA, Backend
from kvjax.model.rope import Rope
from kvjax.model.weights import Dense, make_norm

NEG_INF = -1e30


def kv_head_of(query_head: int | np.ndarray, num_heads: int, num_kv_heads: int):
  """The kv head that query head(s) `query_head` read: contiguous groups of num_heads // num_kv_heads."""
  return query_head // (num_heads // num_kv_heads)


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """[B, T, N, H] -> [B, T, K, G, H]; the reshape realises `kv_head_of`."""
  b, t, n, h = q.shape
  return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, k_transposed: bool = False) -> jax.Array:
  """Scaled dot-product attention with grouped queries; K/V are never repeated.

  Args:
    q: [B, T, N, H] queries (already rotated).
    k: [B, K, S, H] keys, or [B, K, H, S] (the contiguous cache's layout) when k_transposed.
    v: [B, K, S, H] values.
    mask: bool [B, T, S], True where query t may read key s; [B, K, T, S] per kv head.
  Returns:
    [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q.shape
  q = group_queries(q, v.shape[1]) * (h**-0.5)  # [B, T, K, G, H]
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  if t == 1 and k_transposed:
    # One query token against the cache: the query axis is added after the scores dot, since
    # with it jnp.einsum orders the contraction into a dot that XLA's CPU backend runs slower
    # when G > 1.
    scores = jnp.einsum("bkgh,bkhs->bkgs", q[:, 0], k, preferred_element_type=jnp.float32)[:, :, :, None]
  else:
    k_spec = "bkhs" if k_transposed else "bksh"
    scores = jnp.einsum(f"btkgh,{k_spec}->bkgts", q, k, preferred_element_type=jnp.float32)
  mask = mask[:, :, None] if mask.ndim == 4 else mask[:, None, None]  # [B, K or 1, 1, T, S]
  scores = jnp.where(mask, scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  # For one query token the output is asked for as [B, K, G, 1, H], which keeps probs as the
  # dot's left operand; [B, T, K, G, H] would make einsum swap the operands into a [B, K, H, G]
  # dot that XLA's CPU backend runs several times slower when G > 1. For longer queries
  # (prefill, training) the swapped form is the faster one.
  spec = "bkgts,bksh->bkgth" if t == 1 else "bkgts,bksh->btkgh"
  return jnp.einsum(spec, probs, v).reshape(b, t, n, h)


@dataclasses.dataclass(frozen=True)
class Field:
  """One array a layer's attention hands its cache per token: `heads` vectors of `width`.
  transposed: read as the right operand of the scores, so a contiguous cache stores it
  [B, heads, width, S] (kvjax.cache.contiguous)."""

  heads: int
  width: int
  transposed: bool = False


def kv_payload(config: ModelConfig) -> dict[str, Field]:
  """What an Attention layer caches per token: k and v, num_kv_heads vectors of head_dim."""
  return {
    "k": Field(config.num_kv_heads, config.head_dim, transposed=True),
    "v": Field(config.num_kv_heads, config.head_dim),
  }


@flax.struct.dataclass
class KVQuery:
  """Queries q [B, Tq, N, H] (rotated) of an Attention layer, as its cache kind reads them.
  call_q: the queries of every column of the call [B, T, N, H] when the call asked for some
  columns' outputs only (q is then those columns'); what an evicting cache's press scores keys
  by (kvjax.cache.presses). Unused, it is never computed (XLA drops it). rope: the layer's RoPE
  (None with learned positions), static: what a press that reads un-rotated queries turns them by."""

  q: jax.Array
  call_q: jax.Array | None = None
  rope: Rope | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def every_q(self) -> jax.Array:
    """[B, T, N, H]: the queries of every column of the call."""
    return self.q if self.call_q is None else self.call_q

  @property
  def kernel_query(self) -> jax.Array:
    """The queries a decode kernel takes (backend.cache_attention)."""
    return self.q

  def attend(self, arrays: dict, keys: "Visibility", *, transposed: bool = False, absorb: bool = False) -> jax.Array:
    """Reads k and v [B, K, S, H] (k [B, K, H, S] when `transposed`) as `keys` says -> [B, Tq, N, H]."""
    return attend_keys(self.q, arrays["k"], arrays["v"], keys, k_transposed=transposed)


@dataclasses.dataclass(frozen=True)
class Window:
  """One layer's sliding window: size 0 is a global layer; otherwise a query at t reads keys
  s > t - size and the first `sinks` positions (ModelConfig.window, sink_tokens)."""

  size: int = 0
  sinks: int = 0

  @classmethod
  def of_layer(cls, config: ModelConfig, layer: int) -> "Window":
    size = config.layer_window(layer)
    return cls(size, config.sink_tokens if size else 0)


GLOBAL = Window()


def visible(q_positions: jax.Array, key_positions: jax.Array, window: Window) -> jax.Array:
  """The attention mask of kvjax, for every path (training, every cache kind).

  Args:
    q_positions: int[B, Tq], the queries' positions.
    key_positions: int[B, S] (or [1, S]), the position of each key; negative for an empty slot.
      int[B, K, S] when each kv head holds keys of its own positions (an evicting cache).
    window: the layer's Window.
  Returns:
    bool [B, Tq, S] ([B, K, Tq, S] for per-head keys): query t reads key s iff 0 <= s <= t,
    and, in a windowed layer, t - s < window.size or s < window.sinks.
  """
  if key_positions.ndim == 3:
    t, s = q_positions[:, None, :, None], key_positions[:, :, None, :]
  else:
    t, s = q_positions[:, :, None], key_positions[:, None, :]
  mask = (s >= 0) & (s <= t)
  if window.size:
    mask &= (t - s < window.size) | (s < window.sinks)
  return mask


@flax.struct.dataclass
class Visibility:
  """Which keys each query reads, by position (`visible`), without materialising the mask:
  q_positions int[B, Tq]; key_positions int[B, S] or [1, S] (negative: an empty slot); the
  layer's window (static). Long queries read their keys block by block (`blocked_attend`)."""

  q_positions: jax.Array
  key_positions: jax.Array
  window: Window = flax.struct.field(pytree_node=False, default=GLOBAL)

  def mask(self) -> jax.Array:
    """bool [B, Tq, S]."""
    return visible(self.q_positions, self.key_positions, self.window)


# Query and key tiles of blocked attention: queries and keys both at least 2 * BLOCK long are read
# a tile at a time, so memory holds [BLOCK, BLOCK] scores per head, never [Tq, S].
BLOCK = 256


def blocked_attend(
  q: jax.Array, k: jax.Array, v: jax.Array, keys: Visibility, *, k_transposed: bool = False, block: int = BLOCK
) -> jax.Array:
  """`attend` over query and key tiles of `block` with an online softmax (flash attention): a
  scan over query tiles, each a scan over key tiles carrying the running max, sum and output.
  Per pair of tiles, by the positions: a key tile that no query of the tile may read (above the
  causal diagonal, outside a window) is skipped, one that every query reads all of is computed
  without a mask, and only the others (the diagonal, edges, padding) are masked. The G query
  heads of a kv head are one matrix of G x block rows against each key tile. Same arguments as
  `attend`, the mask given as positions -> [B, T, N, H]. A query that reads no key gives zeros."""
  b, t, n, h = q.shape
  kv, s = v.shape[1], v.shape[2]
  g = n // kv
  q = group_queries(q, kv) * (h**-0.5)  # [B, T, K, G, H]
  k = (k.swapaxes(2, 3) if k_transposed else k).astype(q.dtype)  # [B, K, S, H]
  v = v.astype(q.dtype)
  nq, nk = -(-t // block), -(-s // block)
  pad = lambda x, axis, size, value=0: jnp.pad(
    x, [(0, size - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)], constant_values=value
  )
  q_pos = pad(jnp.broadcast_to(keys.q_positions, (b, t)), 1, nq * block).reshape(b, nq, block).swapaxes(0, 1)
  k_pos = pad(jnp.broadcast_to(keys.key_positions, (b, s)), 1, nk * block, -1).reshape(b, nk, block).swapaxes(0, 1)
  q_tiles = pad(q, 1, nq * block).reshape(b, nq, block, kv, g, h).transpose(1, 0, 3, 4, 2, 5)  # [nq, B, K, G, Tb, H]
  q_tiles = q_tiles.reshape(nq, b, kv, g * block, h)
  k_tiles = pad(k, 2, nk * block).reshape(b, kv, nk, block, h).transpose(2, 0, 1, 3, 4)  # [nk, B, K, Sb, H]
  v_tiles = pad(v, 2, nk * block).reshape(b, kv, nk, block, h).transpose(2, 0, 1, 3, 4)

  def query_tile(_, tile):
    qt, qp = tile  # [B, K, G*Tb, H], [B, Tb]

    def key_tile(carry, key):
      kt, vt, kp = key
      mask = visible(qp, kp, keys.window)  # [B, Tb, Sb]

      def update(masked: bool):
        def run(carry):
          m, total, acc = carry  # [B, K, G, Tb] twice, [B, K, G*Tb, H]
          scores = jnp.einsum("bkqh,bksh->bkqs", qt, kt, preferred_element_type=jnp.float32)
          scores = scores.reshape(b, kv, g, block, block)
          if masked:
            m_new = jnp.maximum(m, jnp.where(mask[:, None, None], scores, NEG_INF).max(-1))
            p = jnp.where(mask[:, None, None], jnp.exp(scores - m_new[..., None]), 0.0)
          else:
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.exp(scores - m_new[..., None])
          fix = jnp.exp(m - m_new)
          p_rows = p.astype(vt.dtype).reshape(b, kv, g * block, block)
          pv = jnp.einsum("bkqs,bksh->bkqh", p_rows, vt, preferred_element_type=jnp.float32)
          return m_new, total * fix + p.sum(-1), acc * fix.reshape(b, kv, g * block, 1) + pv

        return run

      case = jnp.where(mask.all(), 1, jnp.where(mask.any(), 2, 0))
      return lax.switch(case, [lambda c: c, update(False), update(True)], carry), None

    init = (
      jnp.full((b, kv, g, block), NEG_INF, jnp.float32),
      jnp.zeros((b, kv, g, block), jnp.float32),
      jnp.zeros((b, kv, g * block, h), jnp.float32),
    )
    (_, total, acc), _ = lax.scan(key_tile, init, (k_tiles, v_tiles, k_pos))
    return None, (acc / jnp.where(total > 0, total, 1.0).reshape(b, kv, g * block, 1)).astype(q.dtype)

  _, out = lax.scan(query_tile, None, (q_tiles, q_pos))  # [nq, B, K, G*Tb, H]
  out = out.reshape(nq, b, kv, g, block, h).transpose(1, 0, 4, 2, 3, 5)  # [B, nq, Tb, K, G, H]
  return out.reshape(b, nq * block, n, h)[:, :t]


def attend_keys(q, k, v, keys: Visibility, *, k_transposed: bool = False) -> jax.Array:
  """`attend` with the mask given as positions: blocked (`blocked_attend`) when both the queries
  and the keys span two tiles or more, else over the materialised mask."""
  if q.shape[1] >= 2 * BLOCK and v.shape[2] >= 2 * BLOCK and keys.key_positions.ndim == 2:
    return blocked_attend(q, k, v, keys, k_transposed=k_transposed)
  return attend(q, k, v, keys.mask(), k_transposed=k_transposed)


@flax.struct.dataclass
class Span:
  """The positions one forward call covers in each row.

  positions: int32[B, T], row b's new tokens sit at positions[b, :lengths[b]] (consecutive, from
    the number of tokens the row held before the call); columns past lengths[b] are padding.
  lengths: int32[B], new tokens per row.
  from_empty: static; True when no row held any token before the call, so the new K/V are all
    there is to read (attention need not touch the cache's storage).
  window: static; the Window of the layer being run (each Attention sets its own), which a cache
    kind masks by (`visible`) and may lay its storage out by (a ring of window + sinks slots).
  layer: static; the index of that layer (each Attention sets its own): what a per-layer budget
    of an evicting cache is read by (kvjax.cache.presses, Press.layers).
  """

  positions: jax.Array
  lengths: jax.Array
  from_empty: bool = flax.struct.field(pytree_node=False, default=False)
  window: Window = flax.struct.field(pytree_node=False, default=GLOBAL)
  layer: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def valid(self) -> jax.Array:
    """bool [B, T]: the columns that hold real tokens."""
    return jnp.arange(self.positions.shape[1])[None, :] < self.lengths[:, None]


def new_keys(q_positions: jax.Array, span: Span) -> Visibility:
  """Queries at q_positions over this call's valid keys, in span.window."""
  return Visibility(q_positions, jnp.where(span.valid, span.positions, -1), span.window)


class NoCache:
  """The cache kind of a plain forward pass: stores nothing; queries read this call's payload."""

  def layer_window(self, config: ModelConfig, layer: int) -> Window:
    return Window.of_layer(config, layer)

  def attend(self, stored, query, q_positions, new: dict, span: Span, backend: Backend):
    """(stored {}, query (KVQuery, LatentQuery) at q_positions int[B, Tq], new {name: [B, heads,
    T, width]}) -> ({}, [B, Tq, N, H])."""
    return stored, query.attend(new, new_keys(q_positions, span))

  def rotate_in(self, query, new: dict):
    return query, new

  def rotate_out(self, out: jax.Array) -> jax.Array:
    return out


NO_CACHE = NoCache()


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [B, T, ...] at index int[B, T'] along T -> [B, T', ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


class Attention(nn.Module):
  """Multi-head attention with num_kv_heads K/V heads, over whatever cache kind it is given.
  `layer` is its index in the model, which decides its sliding window (ModelConfig.window)."""

  config: ModelConfig
  backend: Backend = XLA
  layer: int = 0

  def setup(self):
    cfg = self.config
    dense = lambda heads, bias, name: Dense(
      (heads, cfg.head_dim),
      use_bias=bias,
      dtype=cfg.compute_dtype,
      name=name,
      backend=self.backend,
      kernel_init=nn.initializers.normal(cfg.d_model**-0.5),
    )
    self.q = dense(cfg.num_heads, cfg.qkv_bias, "q")  # kernel [D, N, H]
    self.k = dense(cfg.num_kv_heads, cfg.qkv_bias, "k")  # kernel [D, K, H]
    self.v = dense(cfg.num_kv_heads, cfg.qkv_bias, "v")
    if cfg.qk_norm:
      self.q_norm = make_norm(cfg, "q_norm")  # scale [H], shared by the heads
      self.k_norm = make_norm(cfg, "k_norm")
    self.out = Dense(
      cfg.d_model,
      axes=2,
      use_bias=cfg.use_bias,
      dtype=cfg.compute_dtype,
      name="out",
      backend=self.backend,
      kernel_init=nn.initializers.normal((cfg.num_heads * cfg.head_dim) ** -0.5 / (2 * cfg.num_layers) ** 0.5),
    )

  @property
  def rope(self) -> Rope | None:
    """The layer's RoPE (ModelConfig.layer_rope_theta); None with learned positions."""
    cfg = self.config
    return Rope(cfg.layer_rope_theta(self.layer), cfg.head_dim, cfg.rope_scaling) if cfg.positions == "rope" else None

  def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, heads, H] at positions int[B, T] -> RoPE-rotated at the layer's base
    (unchanged with learned positions)."""
    return x if self.rope is None else self.rope.rotate(x, positions)

  def query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, D], positions int[B, T] -> q [B, T, N, H] (normalised per head with qk_norm, then rotated)."""
    q = self.q(x)
    return self.rotate(self.q_norm(q) if self.config.qk_norm else q, positions)

  def key_value(self, x: jax.Array, positions: jax.Array):
    """x [B, T, D], positions int[B, T] -> k and v [B, K, T, H]."""
    k, v = self.k(x), self.v(x)
    k = self.rotate(self.k_norm(k) if self.config.qk_norm else k, positions)
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def __call__(self, x: jax.Array, span: Span, cache=NO_CACHE, outputs_at: jax.Array | None = None) -> jax.Array:
    """x [B, T, D] -> [B, T, D]; with outputs_at int[B, T'] only those columns' queries attend
    (every column's K/V are still stored) -> [B, T', D]."""
    span = span.replace(window=cache.layer_window(self.config, self.layer), layer=self.layer)
    k, v = self.key_value(x, span.positions)
    query = KVQuery(self.query(x, span.positions), rope=self.rope)
    positions = span.positions
    if outputs_at is not None:
      positions = take_rows(positions, outputs_at)
      query = KVQuery(self.query(take_rows(x, outputs_at), positions), call_q=query.q, rope=self.rope)
    return self.out(cached_attention(self, cache, query, positions, {"k": k, "v": v}, span))


def cached_attention(module: nn.Module, cache, query, q_positions, new: dict, span: Span) -> jax.Array:
  """What every attention module does with its cache: hands it the payload and the query and
  keeps what it stores in the module's 'cache' collection -> [B, Tq, N, H]."""
  stored = dict(module.variables.get("cache", {}))
  query, new = cache.rotate_in(query, new)  # a cache with a rotation stores and reads rotated vectors
  stored, out = cache.attend(stored, query, q_positions, new, span, module.backend)
  for name, value in stored.items():
    module.put_variable("cache", name, value)
  return cache.rotate_out(out)
