"""Decoder-only transformer (Llama / Qwen2 / GPT-2 families) built on `kvjax.model.attention`.

Every Dense layer multiplies through `kvjax.kernels.matmul.dot_general`: XLA's dot, except that a decode
step's few-row float32 products on a single CPU device go to kvjax's CPU kernel.

Parameter tree (kernels in float32, computation in config.dtype):
  embed/embedding [V, D]; pos_embed/embedding [max_len, D] (learned positions)
  layers_{i}/attn_norm, attn/{q,k,v,out}, mlp_norm, mlp/{gate,up,down}
  final_norm; lm_head/kernel [D, V] unless tie_embeddings.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.model.attention import Attention
from kvjax.config import ModelConfig
from kvjax.kernels.matmul import dot_general


def make_norm(cfg: ModelConfig, name: str) -> nn.Module:
  if cfg.norm == "rmsnorm":
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, name=name)
  return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, name=name)


def causal_mask(lengths: jax.Array, seq_len: int) -> jax.Array:
  """bool [B, T, T]: query t reads key s when s <= t and s < lengths[b] (right padding)."""
  pos = jnp.arange(seq_len)
  return (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])


class Mlp(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    def dense(features, name, std):
      return nn.Dense(features, use_bias=cfg.use_bias, dtype=cfg.compute_dtype, name=name,
                      dot_general=dot_general, kernel_init=nn.initializers.normal(std))
    in_std = cfg.d_model ** -0.5
    if cfg.activation == "swiglu":
      h = nn.silu(dense(cfg.mlp_dim, "gate", in_std)(x)) * dense(cfg.mlp_dim, "up", in_std)(x)
    else:
      h = nn.gelu(dense(cfg.mlp_dim, "up", in_std)(x), approximate=True)
    # Residual-branch outputs are scaled down with depth (GPT-2 init).
    return dense(cfg.d_model, "down", (2 * cfg.num_layers * cfg.mlp_dim) ** -0.5)(h)


class Block(nn.Module):
  """Pre-norm residual block. Each method mirrors the matching Attention entry point."""

  config: ModelConfig

  def setup(self):
    self.attn_norm = make_norm(self.config, "attn_norm")
    self.attn = Attention(self.config)
    self.mlp_norm = make_norm(self.config, "mlp_norm")
    self.mlp = Mlp(self.config)

  def _finish(self, x, attn_out):
    x = x + attn_out
    return x + self.mlp(self.mlp_norm(x))

  def __call__(self, x, positions, mask):
    return self._finish(x, self.attn(self.attn_norm(x), positions, mask))

  def prefill(self, x, positions, mask, max_len: int, query_rows=None):
    attn_out = self.attn.prefill(self.attn_norm(x), positions, mask, max_len, query_rows)
    if query_rows is not None:
      x = x[jnp.arange(x.shape[0]), query_rows][:, None]  # [B, 1, D]
    return self._finish(x, attn_out)

  def decode(self, x, lengths):
    return self._finish(x, self.attn.decode(self.attn_norm(x), lengths))


class Transformer(nn.Module):
  """Causal LM. `__call__` is the full forward with no cache; `prefill` / `decode` use the
  'cache' collection (per layer k [B, K, H, max_len], v [B, K, max_len, H], plus lengths int32[B]).
  Prefer the jitted functions in `kvjax.decoding.decode` over calling prefill / decode directly.
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
                          embedding_init=nn.initializers.normal(1.0), name="embed")
    if cfg.positions == "learned":
      self.pos_embed = nn.Embed(cfg.max_len, cfg.d_model, dtype=cfg.compute_dtype,
                                embedding_init=nn.initializers.normal(0.02), name="pos_embed")
    self.layers = [Block(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
    self.final_norm = make_norm(cfg, "final_norm")
    if not cfg.tie_embeddings:
      self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype, name="lm_head",
                              dot_general=dot_general,
                              kernel_init=nn.initializers.normal(cfg.d_model ** -0.5))

  def _embed(self, tokens, positions):
    x = self.embed(tokens)
    if self.config.positions == "learned":
      x = x + self.pos_embed(positions)
    return x

  def _logits(self, x):
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
    return logits.astype(jnp.float32)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens int[B, T] -> logits float32[B, T, V], causal, no cache."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = causal_mask(jnp.full((b,), t), t)
    x = self._embed(tokens, positions)
    for layer in self.layers:
      x = layer(x, positions, mask)
    return self._logits(x)

  def prefill(self, tokens: jax.Array, lengths: jax.Array, max_len: int,
              last_only: bool = False) -> jax.Array:
    """Right-padded prompts tokens int[B, T] with lengths int[B] -> logits [B, T, V] (or, when
    last_only, [B, V] at each prompt's last token: all that generation needs); creates the cache."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = self._embed(tokens, positions)
    mask = causal_mask(lengths, t)
    for i, layer in enumerate(self.layers):
      # With last_only, the last layer computes only each prompt's last token past its K/V.
      query_rows = lengths - 1 if last_only and i == len(self.layers) - 1 else None
      x = layer.prefill(x, positions, mask, max_len, query_rows)
    self.put_variable("cache", "lengths", lengths.astype(jnp.int32))
    return self._logits(x[:, 0] if last_only else x)

  def decode(self, tokens: jax.Array) -> jax.Array:
    """tokens int[B] at positions cache lengths[b] -> logits [B, V]; extends the cache by one."""
    lengths = self.get_variable("cache", "lengths")
    x = self._embed(tokens[:, None], lengths[:, None])
    for layer in self.layers:
      x = layer.decode(x, lengths)
    self.put_variable("cache", "lengths", lengths + 1)
    return self._logits(x)[:, 0]
