"""Which keys a query reads, and attention over them: the one mask of kvjax (`visible`: causal,
and within a windowed layer's sliding window and sinks, `Window`), grouped-query attention over a
materialised mask (`attend`) and blocked over tiles with an online softmax (`blocked_attend`),
chosen by `attend_keys`. Query head n reads kv head n // G (contiguous groups); `kv_head_of` is
that rule, and everything that groups heads (attention, conversion, sharding) goes through it.
The einsum alphabet is kvjax.model.attention's."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.config import ModelConfig

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
