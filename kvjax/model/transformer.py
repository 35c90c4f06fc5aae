"""Decoder-only transformer (Llama / Qwen2 / GPT-2 / Gemma 3 families): the one layer loop.

Training, evaluation, prefill of ragged prompts, appending a chunk to a cache and one-token
decoding all run `Transformer.__call__`; what differs is the cache kind handed in (none,
contiguous, paged, ...; see kvjax.cache) and which columns' logits are asked for.

Parameter tree (kernels in float32, computation in config.dtype):
  embed/embedding [V, D]; pos_embed/embedding [max_len, D] (learned positions)
  layers_{i}/attn_norm, attn/{q,k,v,out} (MLA: attn/{q,kv_down,k_rope,k_up,v_up,out},
  kvjax.model.mla), mlp_norm, mlp/{gate,up,down}; with qk_norm attn/{q_norm,k_norm}/scale [H],
  with post_norms post_attn_norm and post_mlp_norm (Gemma 3)
  final_norm; lm_head/kernel [D, V] unless tie_embeddings.
The 'cache' collection mirrors it: layers_{i}/attn/{name: array} as the cache kind lays it out
(`cache_collection`).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.model.attention import NO_CACHE, Attention, Field, Span, kv_payload, take_rows
from kvjax.model.backend import XLA, Backend
from kvjax.model.mla import LatentAttention, latent_payload
from kvjax.model.weights import Dense, Embed, make_norm


def cache_payload(config: ModelConfig) -> dict[str, Field]:
  """What each layer's attention hands its cache per token (kvjax.model.attention.Field)."""
  return latent_payload(config) if config.is_latent else kv_payload(config)


def cache_collection(config: ModelConfig, layer: Callable[[int], dict]) -> dict:
  """The 'cache' collection for a model of `config`: layer(i) -> {name: array} of layer i's attention."""
  return {f"layers_{i}": {"attn": layer(i)} for i in range(config.num_layers)}


def cache_layers(collection: dict) -> list[dict]:
  """The per-layer {name: array} dicts of a 'cache' collection, in layer order."""
  return [collection[f"layers_{i}"]["attn"] for i in range(len(collection))]


def apply_cached(model, params, cache, tokens, lengths, logits_at=None, from_empty: bool = False):
  """The model over tokens int32[B, T] (lengths int32[B]) through `cache`, whose arrays travel in
  the 'cache' collection (cache.layers) -> (logits as the Transformer returns them at logits_at,
  the collection after the call)."""
  logits, variables = model.apply(
    {"params": params, "cache": cache.layers},
    tokens,
    cache.replace(layers={}),
    lengths=lengths,
    logits_at=logits_at,
    from_empty=from_empty,
    mutable=["cache"],
  )
  return logits, variables["cache"]


class Mlp(nn.Module):
  config: ModelConfig
  backend: Backend = XLA

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config

    def dense(features, name, std):
      return Dense(
        features,
        use_bias=cfg.use_bias,
        dtype=cfg.compute_dtype,
        name=name,
        backend=self.backend,
        kernel_init=nn.initializers.normal(std),
      )

    in_std = cfg.d_model**-0.5
    if cfg.activation in ("swiglu", "geglu"):
      gate = dense(cfg.mlp_dim, "gate", in_std)(x)
      gate = nn.silu(gate) if cfg.activation == "swiglu" else nn.gelu(gate, approximate=True)
      h = gate * dense(cfg.mlp_dim, "up", in_std)(x)
    else:
      h = nn.gelu(dense(cfg.mlp_dim, "up", in_std)(x), approximate=True)
    # Residual-branch outputs are scaled down with depth (GPT-2 init).
    return dense(cfg.d_model, "down", (2 * cfg.num_layers * cfg.mlp_dim) ** -0.5)(h)


class Block(nn.Module):
  """Pre-norm residual block; `layer` is its index (its attention's sliding window and RoPE
  base). With config.post_norms the attention and MLP outputs are normalised too, before each
  residual add (Gemma 2 / 3: post_attn_norm, post_mlp_norm)."""

  config: ModelConfig
  backend: Backend = XLA
  layer: int = 0

  def setup(self):
    self.attn_norm = make_norm(self.config, "attn_norm")
    self.attn = (
      LatentAttention(self.config, self.layer, self.backend)
      if self.config.is_latent
      else Attention(self.config, self.backend, self.layer)
    )
    self.mlp_norm = make_norm(self.config, "mlp_norm")
    self.mlp = Mlp(self.config, self.backend)
    if self.config.post_norms:
      self.post_attn_norm = make_norm(self.config, "post_attn_norm")
      self.post_mlp_norm = make_norm(self.config, "post_mlp_norm")

  def __call__(self, x, span: Span, cache=NO_CACHE, outputs_at=None):
    """x [B, T, D] -> [B, T, D], or [B, T', D] at the columns outputs_at int[B, T']."""
    attn_out = self.attn(self.attn_norm(x), span, cache, outputs_at)
    if outputs_at is not None:
      x = take_rows(x, outputs_at)
    mlp = lambda h: self.mlp(self.mlp_norm(h))
    if self.config.post_norms:
      x = x + self.post_attn_norm(attn_out)
      return x + self.post_mlp_norm(mlp(x))
    x = x + attn_out
    return x + mlp(x)


class Transformer(nn.Module):
  """Causal LM. `backend` routes its products (kvjax.model.backend); the decode entry points in
  kvjax.decoding set it, so build the model with the config alone."""

  config: ModelConfig
  backend: Backend = XLA

  def setup(self):
    cfg = self.config
    self.embed = Embed(
      cfg.vocab_size, cfg.d_model, cfg.compute_dtype, nn.initializers.normal(1.0), self.backend, name="embed"
    )
    if cfg.positions == "learned":
      self.pos_embed = Embed(
        cfg.max_len, cfg.d_model, cfg.compute_dtype, nn.initializers.normal(0.02), name="pos_embed"
      )
    self.layers = [Block(cfg, self.backend, i, name=f"layers_{i}") for i in range(cfg.num_layers)]
    self.final_norm = make_norm(cfg, "final_norm")
    if not cfg.tie_embeddings:
      self.lm_head = Dense(
        cfg.vocab_size,
        use_bias=False,
        dtype=cfg.compute_dtype,
        name="lm_head",
        backend=self.backend,
        kernel_init=nn.initializers.normal(cfg.d_model**-0.5),
      )

  def __call__(
    self,
    tokens: jax.Array,
    cache=None,
    *,
    lengths: jax.Array | None = None,
    logits_at: jax.Array | None = None,
    from_empty: bool = False,
  ) -> jax.Array:
    """Logits of right-padded tokens, written after what each row of `cache` holds.

    Args:
      tokens: int[B, T]; row b's new tokens are tokens[b, :lengths[b]].
      cache: a cache kind (kvjax.cache) whose `lengths` int[B] are the tokens each row holds,
        its arrays in the 'cache' collection (apply with mutable=['cache']); None for a plain
        causal forward pass. Its `call_positions(T)` int32[B, T] are the positions of the call's
        columns (row b's from lengths[b] on; a packed call's its own: kvjax.serving.mixed).
      lengths: int[B] new tokens per row (default: all T).
      logits_at: int[B, T'] columns whose logits are wanted (default: all T). The last layer
        computes its attention output and MLP only there.
      from_empty: no row of `cache` holds any token yet (see Span).
    Returns:
      float32 [B, T, V], or [B, T', V] at logits_at.
    """
    b, t = tokens.shape
    span = Span(
      positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if cache is None else cache.call_positions(t),
      lengths=jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32),
      from_empty=cache is None or from_empty,
    )
    cache = NO_CACHE if cache is None else cache
    x = self.embed(tokens)
    if self.config.scale_embeddings:
      # Rounded to the compute dtype first, as Gemma does; a tied lm_head reads the unscaled table.
      x = x * jnp.asarray(self.config.d_model**0.5, x.dtype)
    if self.config.positions == "learned":
      x = x + self.pos_embed(span.positions)
    last = len(self.layers) - 1
    for i, layer in enumerate(self.layers):
      x = layer(x, span, cache, logits_at if i == last else None)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
    return logits.astype(jnp.float32)
