"""Grouped-query attention: one code path for MHA, GQA and MQA, with a preallocated KV cache.

Einsum alphabet, used across kvjax:
  B batch, T query length, S key length, D model dim, N query heads = K * G,
  K kv heads, G query heads per kv head (q_per_kv), H head dim, F MLP hidden, V vocab.

Query head n reads kv head n // G (contiguous groups); `kv_head_of` is that rule, and
everything that groups heads (attention, conversion, sharding) goes through it.

The cache is kv-head-major, so each (batch, kv head) pair reads one contiguous block per decode
step: values [B, K, S, H] and keys transposed, [B, K, H, S]. With the sequence-major layout
[B, S, K, H], XLA's CPU dot transposes the whole cache on every step (measured at batch 32, 1024
positions, 8 kv heads: decode attention 10x slower). With keys stored [H, S], the decode scores
dot is an ordinary [G, H] x [H, S] matrix product with S contiguous; measured against keys
[B, K, S, H] in alternating runs of the decode step: batch 32, 1024 positions, 8 heads of 64:
74-87 -> 70-83 ms; batch 64, 512 positions, 16 heads of 12: 41-43 -> 35-43 ms, and with 2 kv
heads 15-16 -> 12-13 ms. Training and prefill attend over fresh [B, K, S, H] keys.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels import build as cpu_kernels
from kvjax.config import ModelConfig
from kvjax.kernels.matmul import dot_general

NEG_INF = -1e30

# The sequence axis of each cache buffer: k [B, K, H, S], v [B, K, S, H].
CACHE_SEQ_AXIS = {"k": 3, "v": 2}


def kv_head_of(query_head: int | np.ndarray, num_heads: int, num_kv_heads: int):
  """The kv head that query head(s) `query_head` read: contiguous groups of num_heads // num_kv_heads."""
  return query_head // (num_heads // num_kv_heads)


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """[B, T, N, H] -> [B, T, K, G, H]; the reshape realises `kv_head_of`."""
  b, t, n, h = q.shape
  return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half convention). x [B, T, heads, H], positions int[B, T]."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
  angle = positions[..., None].astype(jnp.float32) * freq  # [B, T, H/2]
  sin = jnp.sin(angle)[:, :, None, :]
  cos = jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
           k_transposed: bool = False) -> jax.Array:
  """Scaled dot-product attention with grouped queries; K/V are never repeated.

  Args:
    q: [B, T, N, H] queries (already rotated).
    k: [B, K, S, H] keys, or [B, K, H, S] (the cache's layout) when k_transposed.
    v: [B, K, S, H] values.
    mask: bool [B, T, S], True where query t may read key s.
  Returns:
    [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q.shape
  q = group_queries(q, v.shape[1]) * (h ** -0.5)  # [B, T, K, G, H]
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  if t == 1 and k_transposed:
    # Decode from the cache. The query axis is added after the scores dot: with it, jnp.einsum
    # orders the contraction into a dot that XLA's CPU backend runs 1.5-4x slower when G > 1.
    scores = jnp.einsum("bkgh,bkhs->bkgs", q[:, 0], k, preferred_element_type=jnp.float32)[:, :, :, None]
  else:
    k_spec = "bkhs" if k_transposed else "bksh"
    scores = jnp.einsum(f"btkgh,{k_spec}->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  # For one query token the output is asked for as [B, K, G, 1, H], which keeps probs as the
  # dot's left operand; asking for [B, T, K, G, H] makes einsum swap the operands into a
  # [B, K, H, G] dot that XLA's CPU backend runs 4-5x slower when G > 1 (GQA decode step, batch
  # 64: 35 -> 20 ms). For longer queries (prefill, training) the swapped form is the faster one.
  spec = "bkgts,bksh->bkgth" if t == 1 else "bkgts,bksh->btkgh"
  return jnp.einsum(spec, probs, v).reshape(b, t, n, h)


def uses_cache_kernel(*dtypes) -> bool:
  """Whether `attend_cache` with operands of these dtypes runs in the CPU kernel."""
  return (all(d == jnp.float32 for d in dtypes) and cpu_kernels.single_cpu()
          and cpu_kernels.available("attention"))


def attend_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array) -> jax.Array:
  """One query token per row against the cache: row b reads positions [0, lengths[b]].

  Args:
    q: [B, 1, N, H] queries (already rotated).
    k_cache: [B, K, H, S] keys; v_cache: [B, K, S, H] values.
    lengths: int32[B], the position of each row's new token (already written to the cache).
  Returns:
    [B, 1, N, H] in q's dtype.
  On a single CPU device, in float32, the CPU kernel (csrc/decode_attention.cc) computes it
  reading only each row's valid positions; otherwise XLA's masked `attend` over the whole cache.
  """
  if q.shape[1] != 1:
    raise ValueError(f"attend_cache takes one query token per row, got q of shape {q.shape}")

  def xla(q, k_cache, v_cache, lengths):
    mask = (jnp.arange(v_cache.shape[CACHE_SEQ_AXIS["v"]])[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
    return attend(q, k_cache, v_cache, mask, k_transposed=True)

  if not uses_cache_kernel(q.dtype, k_cache.dtype, v_cache.dtype):
    return xla(q, k_cache, v_cache, lengths)

  @jax.custom_jvp
  def kernel(q, k_cache, v_cache, lengths):
    b, _, n, h = q.shape
    grouped = group_queries(q, k_cache.shape[1])[:, 0] * (h ** -0.5)  # [B, K, G, H]
    out = jax.ffi.ffi_call(cpu_kernels.KERNELS["attention"][0], jax.ShapeDtypeStruct(grouped.shape, q.dtype),
                           vmap_method="sequential")(grouped, k_cache, v_cache, lengths.astype(jnp.int32) + 1)
    return out.reshape(b, 1, n, h)

  # Tangents are XLA's: the kernel only runs forward.
  kernel.defjvp(lambda primals, tangents: (kernel(*primals), jax.jvp(xla, primals, tangents)[1]))
  # Chosen when lowering: a function traced here may still be compiled for an accelerator.
  return jax.lax.platform_dependent(q, k_cache, v_cache, lengths, cpu=kernel, default=xla)


def write_rows(cache: jax.Array, update: jax.Array, starts: jax.Array, axis: int) -> jax.Array:
  """Writes update[b] into cache[b] from position starts[b] of the sequence axis `axis`.

  E.g. values: cache [B, K, S, H], update [B, K, T, H], axis 2. Callers check that
  starts + T <= S beforehand: dynamic_update_slice would clamp an overflowing write.
  """
  def one(row, new, start):
    index = [0] * row.ndim
    index[axis - 1] = start
    return jax.lax.dynamic_update_slice(row, new.astype(row.dtype), index)
  return jax.vmap(one)(cache, update, starts)


class Attention(nn.Module):
  """Multi-head attention with num_kv_heads K/V heads.

  Three entry points share the projections and `attend`:
    __call__: full causal attention, no cache (training, reference forward).
    prefill:  attention over a right-padded prompt; creates the cache and writes it.
    decode:   one token per sequence at position lengths[b]; reads and extends the cache.
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    dense = lambda heads, bias, name: nn.DenseGeneral(
        (heads, cfg.head_dim), use_bias=bias, dtype=cfg.compute_dtype, name=name,
        dot_general=dot_general, kernel_init=nn.initializers.normal(cfg.d_model ** -0.5))
    self.q = dense(cfg.num_heads, cfg.qkv_bias, "q")  # kernel [D, N, H]
    self.k = dense(cfg.num_kv_heads, cfg.qkv_bias, "k")  # kernel [D, K, H]
    self.v = dense(cfg.num_kv_heads, cfg.qkv_bias, "v")
    self.out = nn.DenseGeneral(
        cfg.d_model, axis=(-2, -1), use_bias=cfg.use_bias, dtype=cfg.compute_dtype, name="out",
        dot_general=dot_general,
        kernel_init=nn.initializers.normal((cfg.num_heads * cfg.head_dim) ** -0.5 / (2 * cfg.num_layers) ** 0.5))

  def query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, D], positions int[B, T] -> q [B, T, N, H]."""
    q = self.q(x)
    return rope(q, positions, self.config.rope_theta) if self.config.positions == "rope" else q

  def key_value(self, x: jax.Array, positions: jax.Array):
    """x [B, T, D], positions int[B, T] -> k and v [B, K, T, H]."""
    k, v = self.k(x), self.v(x)
    if self.config.positions == "rope":
      k = rope(k, positions, self.config.rope_theta)
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def project(self, x: jax.Array, positions: jax.Array):
    """x [B, T, D], positions int[B, T] -> q [B, T, N, H], k and v [B, K, T, H]."""
    return self.query(x, positions), *self.key_value(x, positions)

  def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    q, k, v = self.project(x, positions)
    return self.out(attend(q, k, v, mask))

  def prefill(self, x, positions, mask, max_len: int, query_rows: jax.Array | None = None) -> jax.Array:
    """Like __call__, and stores the prompt's K/V at positions [0, T) of a new cache:
    k [B, K, H, max_len], v [B, K, max_len, H]. With query_rows (int[B]) only the token at
    position query_rows[b] of each row attends, [B, 1, D] out: the cache still gets every
    position (the last layer's other outputs are not needed to sample the next token)."""
    cfg = self.config
    k, v = self.key_value(x, positions)
    b, kv, h = x.shape[0], cfg.num_kv_heads, cfg.head_dim
    for name, new, shape in (("k", k.swapaxes(2, 3), (b, kv, h, max_len)), ("v", v, (b, kv, max_len, h))):
      buf = jnp.zeros(shape, cfg.kv_dtype)
      self.put_variable("cache", name, jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, 0, 0, 0)))
    if query_rows is not None:
      x, positions, mask = (a[jnp.arange(b), query_rows][:, None] for a in (x, positions, mask))
    return self.out(attend(self.query(x, positions), k, v, mask))

  def decode(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
    """x [B, 1, D] is the token at position lengths[b]; its K/V are written there, then it attends to [0, lengths[b]]."""
    q, k, v = self.project(x, lengths[:, None])
    k_cache = write_rows(self.get_variable("cache", "k"), k.swapaxes(2, 3), lengths, CACHE_SEQ_AXIS["k"])
    v_cache = write_rows(self.get_variable("cache", "v"), v, lengths, CACHE_SEQ_AXIS["v"])
    self.put_variable("cache", "k", k_cache)
    self.put_variable("cache", "v", v_cache)
    return self.out(attend_cache(q, k_cache, v_cache, lengths))
