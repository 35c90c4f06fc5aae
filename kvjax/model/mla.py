"""Multi-head latent attention (MLA, DeepSeek-V2): per token one latent c [r] shared by all heads
and one shared rotary key; everything else a head reads is up-projected from c.

Alphabet of kvjax.model.attention, plus R latent rank, W rotary dims per group
(config.rope_group_dims), E = H - W position-free dims per head.

Query head n splits its H dims into E position-free dims and W rotary dims (the last W):
  score(n, t, s) = q_nope[n, t] . k_nope[n, s] + q_rope[n, t] . k_rope[kv_head_of(n), s]
  k_nope[n, s] = c_s @ k_up[:, n]   [E]      v[n, s] = c_s @ v_up[:, n]   [H]
scaled by H^-0.5 like any head. k_rope [K, W] holds one rotary key per group of query heads
(K = num_kv_heads: one group is DeepSeek's single shared rotary key; a model converted from K kv
heads keeps each kv head's strongest frequency pairs, kvjax.conversion.mla). Each group's W dims
are rotate-half pairs (dims j and j + W/2) whose frequencies `rope_frequencies` gives.

The cache stores c [R] and k_rope [K * W = rope_dims] per token. Two forms of the same function:
  expanded (training, prefill): k_nope and v are materialised per head from c.
  absorbed (decoding from a cache): k_up is folded into the query, q_lat[n] = k_up[:, n] @ q_nope[n]
    [R], so scores read c directly; the probabilities weight c, and v_up (then the output
    projection) is applied to that [R] average: no per-head K/V is ever formed.
Parameters (layers_{i}/attn): q [D, N, H], kv_down [D, R], k_rope [D, K*W] (biases when
qkv_bias), k_up [R, N, E], v_up [R, N, H], out [N, H, D].
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model.attention import NO_CACHE, Field, Span, cached_attention, take_rows
from kvjax.model.keys import NEG_INF, Visibility
from kvjax.model.backend import XLA, Backend
from kvjax.model.rope import apply_rope, frequencies
from kvjax.model.weights import Dense

ABSORB_ROWS = 2  # rows per step of the absorbed read's loop (LatentQuery.absorbed)


def rope_frequencies(config: ModelConfig, layer: int) -> np.ndarray:
  """float32 [K, W/2]: the rotation frequency of each rotary pair of each group of `layer`: the
  frequencies of a RoPE head W wide, or, for a converted model (rope_pairs), the source head's
  (head_dim wide, scaled alike) at each kept pair's index."""
  k, w = config.num_kv_heads, config.rope_group_dims
  if config.rope_pairs is None:
    return np.tile(frequencies(config.rope_theta, w, config.rope_scaling), (k, 1))
  index = np.asarray(config.rope_pairs[layer]).reshape(k, w // 2)
  return frequencies(config.rope_theta, config.head_dim, config.rope_scaling)[index]


def latent_payload(config: ModelConfig) -> dict[str, Field]:
  """What an MLA layer caches per token: the latent [R] and, with RoPE, the rotary key [rope_dims],
  one of each whatever the number of heads (one "head" in the cache's layout)."""
  payload = {"latent": Field(1, config.kv_latent_rank)}
  if config.rope_dims:
    payload["rope_key"] = Field(1, config.rope_dims)
  return payload


@flax.struct.dataclass
class LatentQuery:
  """What an MLA layer hands its cache kind: the queries and the up-projections they need.

  nope: [B, Tq, N, E] position-free queries; rope: [B, Tq, N, W] rotated queries (W may be 0);
  k_up: [R, N, E]; v_up: [R, N, H]. Scores are scaled by head_dim^-0.5.
  """

  nope: jax.Array
  rope: jax.Array
  k_up: jax.Array
  v_up: jax.Array

  @property
  def kernel_query(self) -> None:
    """No decode kernel reads latents: every read is the absorbed (or expanded) form."""
    return None

  def map_tokens(self, fn) -> "LatentQuery":
    """The query with fn applied to its per-token arrays (KVQuery.map_tokens)."""
    return self.replace(nope=fn(self.nope), rope=fn(self.rope))

  def attend(
    self, arrays: dict, keys: Visibility, *, transposed: bool = False, absorb: bool = False, backend=None
  ) -> jax.Array:
    """Reads the latent [B, 1, S, R] and rope_key [B, 1, S, K*W] a cache holds (or this call's)
    as `keys` says, absorbed or expanded -> [B, Tq, N, H]; in XLA whatever the backend."""
    mask = keys.mask()
    latent = arrays["latent"][:, 0]
    rope_key = arrays["rope_key"][:, 0] if "rope_key" in arrays else jnp.zeros(latent.shape[:2] + (0,), latent.dtype)
    return (self.absorbed if absorb else self.expanded)(latent, rope_key, mask)

  def _rope_scores(self, rope: jax.Array, rope_key: jax.Array) -> jax.Array:
    """One row: rope [Tq, N, W] against rope_key [S, K*W] -> [N, Tq, S] (query head n against
    its group's rotary key)."""
    t, n, w = rope.shape
    k = rope_key.shape[-1] // w if w else 1
    keys = rope_key.reshape(rope_key.shape[0], k, w).astype(rope.dtype)
    scores = jnp.einsum("tkgw,skw->kgts", rope.reshape(t, k, n // k, w), keys, preferred_element_type=jnp.float32)
    return scores.reshape(n, t, -1)

  def _probs(self, scores: jax.Array, mask: jax.Array) -> jax.Array:
    """One row: scores [N, Tq, S] (unscaled), mask bool [Tq, S] -> probabilities [N, Tq, S]."""
    scores = jnp.where(mask[None], scores * self.v_up.shape[-1] ** -0.5, NEG_INF)
    return jax.nn.softmax(scores, axis=-1).astype(self.nope.dtype)

  def expanded(self, latent: jax.Array, rope_key: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention with per-head keys and values formed from latent [B, S, R]; rope_key [B, S, K*W],
    mask bool [B, Tq, S] -> [B, Tq, N, H]."""
    dtype = self.nope.dtype
    latent = latent.astype(dtype)
    k_nope = jnp.einsum("bsr,rne->bsne", latent, self.k_up.astype(dtype))
    v = jnp.einsum("bsr,rnh->bsnh", latent, self.v_up.astype(dtype))
    scores = jnp.einsum("btne,bsne->bnts", self.nope, k_nope, preferred_element_type=jnp.float32)
    probs = jax.vmap(lambda s, q, k, m: self._probs(s + self._rope_scores(q, k), m))(scores, self.rope, rope_key, mask)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)

  def absorbed(self, latent: jax.Array, rope_key: jax.Array, mask: jax.Array) -> jax.Array:
    """The same attention read in the latent space (see the module docstring): latent [B, S, R],
    rope_key [B, S, K*W], mask bool [B, Tq, S] -> [B, Tq, N, H].

    Rows are taken ABSORB_ROWS at a time (lax.map): a row's latents are read twice, by the scores
    and by the weighted sum, and between the two they are still in the CPU's cache; the batched
    products would stream the whole batch's latents from memory twice.
    """
    dtype = self.nope.dtype
    q_latent = jnp.einsum("btne,rne->btnr", self.nope, self.k_up.astype(dtype))  # [B, Tq, N, R]

    def row(args):
      c, k_rope, q, q_rope, m = args  # [S, R], [S, K*W], [Tq, N, R], [Tq, N, W], [Tq, S]
      t, n, r = q.shape
      c = c.astype(dtype)
      # Plain [Tq*N, R] x [R, S] and [Tq*N, S] x [S, R] products: einsum's orderings of the
      # same contractions run several times slower on XLA's CPU backend.
      scores = (q.reshape(t * n, r) @ c.T).reshape(t, n, -1).swapaxes(0, 1)  # [N, Tq, S]
      probs = self._probs(scores + self._rope_scores(q_rope, k_rope), m)
      return (probs.swapaxes(0, 1).reshape(t * n, -1) @ c).reshape(t, n, r)  # [Tq, N, R]

    o_latent = jax.lax.map(row, (latent, rope_key, q_latent, self.rope, mask), batch_size=ABSORB_ROWS)
    return jnp.einsum("btnr,rnh->btnh", o_latent, self.v_up.astype(dtype))


class LatentAttention(nn.Module):
  """MLA over whatever cache kind it is given, which stores `latent_payload` (NoCache reads this
  call's latents expanded)."""

  config: ModelConfig
  layer: int = 0
  backend: Backend = XLA

  def setup(self):
    cfg = self.config
    n, h, r, e = cfg.num_heads, cfg.head_dim, cfg.kv_latent_rank, cfg.head_dim - cfg.rope_group_dims
    init = lambda std: nn.initializers.normal(std)
    dense = lambda features, bias, name, std=cfg.d_model**-0.5: Dense(
      features,
      use_bias=bias,
      dtype=cfg.compute_dtype,
      name=name,
      backend=self.backend,
      kernel_init=init(std),
    )
    self.q = dense((n, h), cfg.qkv_bias, "q")
    self.kv_down = dense(r, cfg.qkv_bias, "kv_down")
    if cfg.rope_dims:
      self.k_rope = dense(cfg.rope_dims, cfg.qkv_bias, "k_rope")
    self.k_up = self.param("k_up", init(r**-0.5), (r, n, e))
    self.v_up = self.param("v_up", init(r**-0.5), (r, n, h))
    self.out = Dense(
      cfg.d_model,
      axes=2,
      use_bias=cfg.use_bias,
      dtype=cfg.compute_dtype,
      name="out",
      backend=self.backend,
      kernel_init=init((n * h) ** -0.5 / (2 * cfg.num_layers) ** 0.5),
    )

  def latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D], positions int[B, T] -> (latent [B, T, R], rotated rope_key [B, T, K*W])."""
    cfg = self.config
    c = self.kv_down(x)
    if not cfg.rope_dims:
      return c, jnp.zeros(x.shape[:2] + (0,), c.dtype)
    k_rope = self.k_rope(x).reshape(x.shape[:2] + (cfg.num_kv_heads, cfg.rope_group_dims))
    k_rope = apply_rope(k_rope, positions, rope_frequencies(cfg, self.layer))
    return c, k_rope.reshape(x.shape[:2] + (cfg.rope_dims,))

  def query(self, x: jax.Array, positions: jax.Array) -> LatentQuery:
    """x [B, T, D], positions int[B, T] -> the LatentQuery of these columns."""
    cfg = self.config
    q = self.q(x)  # [B, T, N, H]
    nope, rope = q[..., : cfg.head_dim - cfg.rope_group_dims], q[..., cfg.head_dim - cfg.rope_group_dims :]
    if cfg.rope_dims:
      per_head = np.repeat(rope_frequencies(cfg, self.layer), cfg.q_per_kv, axis=0)  # [N, W/2]
      rope = apply_rope(rope, positions, per_head)
    dtype = cfg.compute_dtype
    return LatentQuery(nope=nope, rope=rope, k_up=self.k_up.astype(dtype), v_up=self.v_up.astype(dtype))

  def __call__(self, x: jax.Array, span: Span, cache=NO_CACHE, outputs_at: jax.Array | None = None) -> jax.Array:
    """x [B, T, D] -> [B, T, D], or [B, T', D] at the columns outputs_at int[B, T']."""
    span = span.replace(window=cache.layer_window(self.config, self.layer))
    latent, rope_key = self.latent(x, span.positions)
    positions = span.positions
    if outputs_at is not None:
      x, positions = take_rows(x, outputs_at), take_rows(positions, outputs_at)
    new = {"latent": latent[:, None]}  # [B, 1, T, R]: one "head"
    if self.config.rope_dims:
      new["rope_key"] = rope_key[:, None]
    return self.out(cached_attention(self, cache, self.query(x, positions), positions, new, span))
