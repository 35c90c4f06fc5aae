"""Grouped-query attention: one code path for MHA, GQA and MQA, whatever the cache.

Einsum alphabet, used across kvjax:
  B batch, T query length, S key length, D model dim, N query heads = K * G,
  K kv heads, G query heads per kv head (q_per_kv), H head dim, F MLP hidden, V vocab.

Query head n reads kv head n // G (contiguous groups: kvjax.model.keys.kv_head_of).

Attention projects queries and this call's keys and values, then hands them to the cache kind
it is given (kvjax.cache) as a payload: the arrays it declares per token (`Field`; {k, v} here,
{latent, rope_key} for MLA, kvjax.model.mla) and a query object that knows how to read them. The
kind stores what it keeps in the Flax 'cache' collection and hands the query what it reads.
`NoCache`, the kind of a plain forward pass (training, evaluation), keeps nothing.

Which keys a query reads is decided in one place, kvjax.model.keys.visible: causal, and within a
windowed layer's sliding window and sinks (`Window`). Each Attention puts its layer's window, as the cache
kind gives it, on the Span (`span.window`), so every kind masks alike.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.model.backend import XLA, Backend
from kvjax.model.keys import GLOBAL, Visibility, Window, attend_keys
from kvjax.model.rope import Rope
from kvjax.model.weights import Dense, make_norm


@dataclasses.dataclass(frozen=True)
class Field:
  """One array a layer's attention hands its cache per token: `heads` vectors of `width`.
  transposed: read as the right operand of the scores, so a contiguous cache stores it
  [B, heads, width, S] (kvjax.cache.layouts.contiguous)."""

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
  (None with learned positions), static: what a press that reads un-rotated queries turns them by.
  out: the layer's output projection float32 [N, H, D] as stored (int8 scaled back), what a press
  that weighs values by their image (CriticalKV) reads; unused, never computed."""

  q: jax.Array
  call_q: jax.Array | None = None
  rope: Rope | None = flax.struct.field(pytree_node=False, default=None)
  out: jax.Array | None = None

  @property
  def every_q(self) -> jax.Array:
    """[B, T, N, H]: the queries of every column of the call."""
    return self.q if self.call_q is None else self.call_q

  @property
  def kernel_query(self) -> jax.Array:
    """The queries a decode kernel takes (backend.cache_attention)."""
    return self.q

  def map_tokens(self, fn) -> "KVQuery":
    """The query with fn applied to its queries ([B, Tq, ...] -> [B', Tq', ...]): how a packed
    call's queries are cut into rows (kvjax.serving.mixed). call_q is dropped: no press reads a
    packed call."""
    return self.replace(q=fn(self.q), call_q=None)

  def attend(
    self, arrays: dict, keys: "Visibility", *, transposed: bool = False, absorb: bool = False, backend: Backend = XLA
  ) -> jax.Array:
    """Reads k and v [B, K, S, H] (k [B, K, H, S] when `transposed`) as `keys` says -> [B, Tq, N, H],
    through `backend`'s prompt attention (a call over its own keys passes its backend)."""
    return backend.prompt_attention(self.q, arrays["k"], arrays["v"], keys, attend_keys, k_transposed=transposed)


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


def row_positions(lengths: jax.Array, t: int) -> jax.Array:
  """int32[B, t]: the positions of a call of t columns after the lengths int[B] each row holds."""
  return lengths[:, None] + jnp.arange(t, dtype=jnp.int32)


def new_keys(q_positions: jax.Array, span: Span) -> Visibility:
  """Queries at q_positions over this call's valid keys, in span.window."""
  return Visibility(q_positions, jnp.where(span.valid, span.positions, -1), span.window)


class NoCache:
  """The cache kind of a plain forward pass: stores nothing; queries read this call's payload.
  A subclass handed to the model as its cache (a test's reference) sets `lengths` int32[B]."""

  lengths: jax.Array | None = None

  def call_positions(self, t: int) -> jax.Array:
    return row_positions(self.lengths, t)

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

  def out_projection(self) -> jax.Array | None:
    """The output projection's kernel float32 [N, H, D] in whatever format it is stored (int8's
    scale applied); None while the model is being initialised (it has no kernel yet)."""
    params = self.out.variables.get("params", {})
    if "kernel" not in params:
      return None
    kernel = params["kernel"].astype(jnp.float32)
    return kernel if "kernel_scale" not in params else kernel * params["kernel_scale"].astype(jnp.float32)

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
    out = self.out_projection()
    query = KVQuery(self.query(x, span.positions), rope=self.rope, out=out)
    positions = span.positions
    if outputs_at is not None:
      positions = take_rows(positions, outputs_at)
      query = KVQuery(self.query(take_rows(x, outputs_at), positions), call_q=query.q, rope=self.rope, out=out)
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
