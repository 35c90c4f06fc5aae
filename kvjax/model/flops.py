"""FLOP counts and peak rates for the model-FLOPs-utilisation (MFU) estimate.

Training FLOPs per token follow the PaLM appendix: 6 per matmul parameter (forward and backward)
plus 12 * L * N * H * T for the attention scores and weighted sum over a T-token context. MFU is
achieved model FLOP/s over the chip's dense bfloat16 peak; on a CPU, whose peak is not tabulated,
over the rate of a large float32 matmul measured once per process.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig

# Dense bfloat16 peak FLOP/s by device_kind substring, most specific first.
PEAK_BF16 = (
  ("H200", 989e12),
  ("H100", 989e12),
  ("A100", 312e12),
  ("L4", 121e12),
  ("TPU v6 lite", 918e12),
  ("TPU v5 lite", 197e12),
  ("TPU v5", 459e12),
  ("TPU v4", 275e12),
)


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters that take part in a matmul per token (embedding lookups excluded)."""
  attn = cfg.d_model * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  mlp = (3 if cfg.activation in ("swiglu", "geglu") else 2) * cfg.d_model * cfg.mlp_dim
  return cfg.num_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
  return 6.0 * matmul_params(cfg) + attention


@functools.cache
def peak_flops() -> tuple[float | None, str]:
  """(peak FLOP/s of the first device or None when unknown, where that number comes from)."""
  device = jax.devices()[0]
  kind = device.device_kind
  for name, peak in PEAK_BF16:
    if name.lower() in kind.lower():
      return peak, f"{name} dense bf16 spec"
  if device.platform != "cpu":
    return None, f"no peak FLOP/s known for {kind!r} (add it to kvjax.model.flops.PEAK_BF16)"
  return _measured_matmul_rate(), "measured float32 matmul on this CPU"


def _measured_matmul_rate(size: int = 1024, repeats: int = 5) -> float:
  x = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  matmul(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best
