"""Memory budgets: what a job will need, against the memory it has, checked before allocating.

Every estimate is arithmetic on the config and the parameter tree's shapes (nothing is
allocated, so a model too large for the machine is refused before it is built) and errs high. In bytes:

  parameters     4 x param_count (kvjax.model.params): float32 weights whatever the compute dtype
  training       parameters + gradients (4 x P) + AdamW's two moments (8 x P) + activations
  activations    what the backward pass keeps, counted in float32 for B x T tokens:
                   per layer and token  4D (block input, residual, the two norm outputs)
                                        + 3NH + 4KH (q, k, v before and after RoPE, attention output)
                                        + 6F (MLP gate, up, activation, product, their gradients)
                                        + 4NT (scores, masked scores, probabilities, their gradient;
                                          6NT from 2 x 256 tokens, where attention runs in tiles and
                                          the scans keep each tile pair's for the backward pass)
                   once per token       2D (final norm) + 3V (logits, log-softmax, its gradient)
                 (coefficients fitted to XLA's memory plan of the train step, and rounded up:
                 the tests check that the estimate bounds that plan within a factor of two)
  forward        one layer's intermediates at a time plus the logits (prefill, extend, eval)
  KV cache       what the cache kind says it takes, checked by its create: kvjax.cache.kinds.cache_bytes
                 (rows of max_len positions), PagedCache.pool_bytes (a pool of given pages)

The corpus, compiled programs and XLA's scratch space are not counted. The memory a job has is
the free memory of its devices: on accelerators memory_stats()'s bytes_limit less bytes_in_use,
summed over the devices (an even split of the need is assumed, the best case, so a refusal is
never wrong about the total); on the CPU the host's MemAvailable (/proc/meminfo, else the free
physical pages), capped by a cgroup memory limit, shared by all CPU devices.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path
from typing import Mapping, Sequence

import jax

from kvjax.config import ModelConfig
from kvjax.model.keys import BLOCK
from kvjax.model.params import param_count

FLOAT32 = 4
# XLA counts bytes in int64: a buffer past this aborts the process however much memory there is.
MAX_BYTES = 2**63 - 1
UNITS = (("EB", 10**18), ("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
CGROUP_FILES = (
  ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def format_bytes(n: int) -> str:
  """1234567 -> '1.2 MB' (decimal units)."""
  for unit, size in UNITS:
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{n} bytes"


def param_bytes(config: ModelConfig) -> int:
  """Bytes of the float32 parameters."""
  return FLOAT32 * param_count(config)


def _kv_heads(config: ModelConfig) -> int:
  """Heads of keys and values a forward pass forms: MLA expands them per query head."""
  return config.num_heads if config.is_latent else config.num_kv_heads


def activation_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
  """What the backward pass keeps for a batch of batch_size x seq_len tokens (module docstring)."""
  d, n, k, h, f = config.d_model, config.num_heads, _kv_heads(config), config.head_dim, config.mlp_dim
  scores = (4 if seq_len < 2 * BLOCK else 6) * n * seq_len  # tiled attention (kvjax.model.keys.blocked_attend)
  per_layer = 4 * d + 3 * n * h + 4 * k * h + 6 * f + scores
  return FLOAT32 * batch_size * seq_len * (config.num_layers * per_layer + 2 * d + 3 * config.vocab_size)


def train_parts(config: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
  """The terms of `train_bytes`, by name, in bytes."""
  params = param_bytes(config)
  return {
    "parameters": params,
    "gradients": params,
    "AdamW moments": 2 * params,
    f"activations for {batch_size} x {seq_len} tokens": activation_bytes(config, batch_size, seq_len),
  }


def train_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
  """Upper estimate of a training run's memory: parameters, gradients, AdamW state, activations."""
  return sum(train_parts(config, batch_size, seq_len).values())


def forward_bytes(config: ModelConfig, batch: int, seq_len: int, logits: int | None = None) -> int:
  """Working memory of one forward pass without gradients (prefill, extend, evaluation) over
  batch x seq_len tokens, beyond the parameters and the cache: one layer's intermediates
  (4D + 3NH + 4KH + 6F + 4NT per token) and the float32 logits of every position, or of `logits`
  positions per row (1 for a prefill that keeps only the last position's, as generate's does: a
  262,144-token vocabulary's logits are 2 MB a position)."""
  d, n, k, h, f = config.d_model, config.num_heads, _kv_heads(config), config.head_dim, config.mlp_dim
  layer = 4 * d + 3 * n * h + 4 * k * h + 6 * f + 4 * n * seq_len
  positions = seq_len if logits is None else min(logits, seq_len)
  return FLOAT32 * batch * (seq_len * layer + positions * 2 * config.vocab_size)


@dataclasses.dataclass(frozen=True)
class Limit:
  """Free memory and where the number comes from."""

  bytes: int
  source: str


def host_limit() -> Limit | None:
  """The host RAM free for this process: MemAvailable, capped by a cgroup limit; None if unknown."""
  free, source = None, None
  try:
    for line in Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemAvailable:"):
        free, source = int(line.split()[1]) * 1024, "host RAM available (MemAvailable, /proc/meminfo)"
  except (OSError, ValueError, IndexError):
    pass
  if free is None:
    try:
      free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
      source = "free host RAM (os.sysconf)"
    except (OSError, ValueError, AttributeError):
      return None
  for limit_file, usage_file in CGROUP_FILES:
    try:
      room = int(Path(limit_file).read_text()) - int(Path(usage_file).read_text())
    except (OSError, ValueError):  # no such cgroup, or the limit reads "max"
      continue
    if room < free:
      free, source = max(room, 0), f"memory left under this process's cgroup limit ({limit_file})"
    break
  return Limit(free, source)


def device_limit(devices: Sequence[jax.Device] | None = None) -> Limit | None:
  """The memory free on `devices` (default: the first device): host RAM for CPU devices, the
  sum of bytes_limit - bytes_in_use of accelerators; None when a device reports no limit."""
  devices = list(devices) if devices is not None else jax.devices()[:1]
  if all(d.platform == "cpu" for d in devices):
    return host_limit()
  free = 0
  for device in devices:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None
    free += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  names = devices[0].device_kind + (f" x {len(devices)}" if len(devices) > 1 else "")
  return Limit(free, f"free memory of {names} (memory_stats bytes_limit - bytes_in_use)")


def available_bytes(devices: Sequence[jax.Device] | None = None) -> int | None:
  """Bytes free on `devices` (default: the first device), per `device_limit`; None if unknown."""
  limit = device_limit(devices)
  return None if limit is None else limit.bytes


def release_free() -> bool:
  """Returns the memory this process has freed to the system where the C library keeps it (glibc's
  malloc_trim): a loop that frees gigabytes per step (the presses table's parts of caches) otherwise
  holds its largest step's memory, and more, resident (measured: 6.0 GB resident after a sample of 30
  of those caches at 2,048 tokens, 2.8 GB with this after each part). False where the C library has no
  such call."""
  try:
    trim = ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError):
    return False
  trim(0)
  return True


def check_fits(
  what: str,
  needed: int | Mapping[str, int],
  *,
  limit: int | Limit | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> None:
  """Raises ValueError giving the estimate and the limit when `what` needs more than there is.

  Args:
    what: the job, as the message's subject ("training", "a contiguous cache of 8 x 4096").
    needed: bytes, or {term: bytes} (the message lists the terms).
    limit: the memory to fit in, in bytes; default: the free memory of `devices` (device_limit).
      Where no limit is known, only sizes beyond XLA's int64 byte counts are refused.
  """
  parts = dict(needed) if isinstance(needed, Mapping) else {}
  total = sum(parts.values()) if parts else int(needed)
  if isinstance(limit, int):
    limit = Limit(limit, "the given limit")
  elif limit is None:
    limit = device_limit(devices)
  if limit is None:
    limit = Limit(MAX_BYTES, "the largest size XLA can address")
  if total <= limit.bytes:
    return
  terms = "".join(f"{' - ' if size < 0 else ' + '}{name} {format_bytes(abs(size))}" for name, size in parts.items())
  raise ValueError(
    f"{what} needs about {format_bytes(total)}"
    + (f" ({terms[3:]})" if terms else "")
    + f", more than the {format_bytes(limit.bytes)} of {limit.source}; refused before allocating"
  )


def check_training(
  config: ModelConfig,
  batch_size: int,
  seq_len: int,
  *,
  resident: int = 0,
  limit: int | Limit | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> None:
  """check_fits of a training run's `train_parts`. resident: bytes of its initial parameters that
  are already in memory (given weights on the device), which the free memory no longer counts."""
  parts = train_parts(config, batch_size, seq_len)
  if resident:
    parts["initial parameters already in memory"] = -resident
  check_fits(f"training ({param_count(config):,} parameters)", parts, limit=limit, devices=devices)
