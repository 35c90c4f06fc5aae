"""expected_attention: the attention future queries are expected to pay each key (kvpress's
ExpectedAttentionPress). The mean mu and covariance C of the prompt's queries before RoPE (its
first `n_sink` left out) are carried by the rotation averaged over the next `n_future_positions`
positions, R; a key k scores softmax_k(k.R mu / sqrt(H) + k.R C R^T k / (2 H)), the mean over the
group, times (that + epsilon) * |v| (use_vnorm); the first n_sink tokens are kept. It reads the
values and un-rotates the queries by the layer's RoPE (`prompt_scores`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.fields import INT32_MAX, check_nonnegative, check_positive, check_real
from kvjax.model.keys import NEG_INF
from kvjax.cache.presses.base import Press, kept_above


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(Press):
  n_future_positions: int = 512
  n_sink: int = 4
  use_covariance: bool = True
  use_vnorm: bool = True
  epsilon: float = 0.0
  name: ClassVar[str] = "expected_attention"

  @property
  def reads_channels(self) -> bool:
    return True

  def __post_init__(self):
    super().__post_init__()
    check_positive(self, "n_future_positions", most=INT32_MAX)
    check_nonnegative(self, "n_sink", most=INT32_MAX)
    for field in ("use_covariance", "use_vnorm"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"ExpectedAttention.{field} must be True or False, got {getattr(self, field)!r}")
    check_real(self, "epsilon", 0, float("inf"))
    object.__setattr__(self, "epsilon", float(self.epsilon))

  def prompt_scores(self, q, k, v, lengths, rope, out=None):
    b, t, _, h = q.shape
    column = jnp.arange(t)[None, :]
    q = q.astype(jnp.float32)
    if rope is not None:  # the queries before RoPE: turned back from positions 0..T-1
      q = rope.rotate(q, jnp.broadcast_to(-column, (b, t)))
    counted = (column >= self.n_sink) & (column < lengths[:, None])  # [B, T]: the statistics' queries
    count = jnp.maximum(lengths - self.n_sink, 1).astype(jnp.float32)[:, None, None]
    mean = jnp.where(counted[..., None, None], q, 0).sum(axis=1) / count  # [B, N, H]
    centred = jnp.where(counted[..., None, None], q - mean[:, None], 0)
    cov = jnp.einsum("btni,btnj->bnij", centred, centred) / count[..., None] if self.use_covariance else None
    if rope is not None:  # the rotation averaged over positions n .. n + n_future_positions - 1
      ahead = (lengths[:, None] + jnp.arange(self.n_future_positions)[None, :]).astype(jnp.float32)  # [B, F]
      angle = ahead[..., None] * jnp.asarray(rope.freq)  # [B, F, H/2]
      cos, sin = jnp.cos(angle).mean(axis=1), jnp.sin(angle).mean(axis=1)  # [B, H/2]
      turn = jnp.block([[_diag(cos), -_diag(sin)], [_diag(sin), _diag(cos)]])  # [B, H, H]
      mean = jnp.einsum("bij,bnj->bni", turn, mean)
      if cov is not None:
        cov = jnp.einsum("bij,bnjl,bml->bnim", turn, cov, turn)
    kv = k.shape[1]
    keys = k.astype(jnp.float32)
    mean = mean.reshape(b, kv, -1, h)  # [B, K, G, H]
    logits = jnp.einsum("bkgh,bkth->bkgt", mean, keys) / h**0.5
    if cov is not None:
      cov = cov.reshape(b, kv, -1, h, h)  # [B, K, G, H, H]
      logits = logits + jnp.einsum("bkti,bkgij,bktj->bkgt", keys, cov, keys) / h / 2
    scored = (column >= self.n_sink) & (column < lengths[:, None])  # [B, T]: keys past the sinks
    weights = jax.nn.softmax(jnp.where(scored[:, None, None], logits, NEG_INF), axis=-1).mean(axis=2)  # [B, K, T]
    if self.use_vnorm:
      weights = (weights + self.epsilon) * jnp.linalg.norm(v.astype(jnp.float32), axis=-1)
    sinks = (column < self.n_sink) & (column < lengths[:, None])
    return kept_above(jnp.where(scored[:, None], weights, -jnp.inf), sinks)


def _diag(x: jax.Array) -> jax.Array:
  """[B, W] -> [B, W, W] diagonal matrices."""
  return x[..., None] * jnp.eye(x.shape[-1], dtype=x.dtype)
