"""KV-cache size planner: `kvjax kv-size MODEL [--context N] [--batch B] [--dtype bf16] ...`.

A model is an Architecture (kvjax.interop.architectures): a ModelConfig, the number of its
weights and a note. The planner asks the cache kinds (kvjax.cache.kinds) what that model's cache
costs in a CacheConfig(layout, dtype, page_size) and does no cache arithmetic of its own:

  bytes per token  kinds.bytes_per_token: every layer's payload (K and V of each kv head, or an
                   MLA layer's latent and rotary key) through the codec, scales included, no
                   sliding window counted
  cache            kinds.cache_bytes: what kinds.create(config, cache_config, batch, context)
                   allocates. A contiguous cache's sliding-window layers keep rings of window +
                   sinks positions, so one whose every layer is windowed fits any context; a
                   paged cache keeps every position, in whole pages
  what fits        the largest batch, and context, whose cache_bytes fit the memory each device
                   has left once its share of the weights is loaded

It prints this for the model as built and its variants, each a ModelConfig the kinds size: the
MHA / GQA / MQA ones (every kv-head count that divides the query heads) and, with
`--mla RANK:ROPE_DIMS`, multi-head latent attention ones (`mla_variant`). Activations and
framework overhead are not counted, and a context past the model's max_len is sized as if the
model took it.

MODEL is a preset name or a model read from files (kvjax.interop.architectures.resolve).
"""

from __future__ import annotations

import math
import re
from typing import Callable

from kvjax.cache import codec as codecs
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.interop.architectures import Architecture

# Cache formats: the codecs' names and their short forms (kvjax.cache.codec).
DTYPE_NAMES = (*codecs.NAMES, *codecs.ALIASES)
# Weight element types.
BYTES_PER_ELEMENT = {
  "fp32": 4,
  "float32": 4,
  "bf16": 2,
  "bfloat16": 2,
  "fp16": 2,
  "float16": 2,
  "fp8": 1,
  "float8_e4m3fn": 1,
  "int8": 1,
}
UNITS = {
  "": 1,
  "b": 1,
  "kb": 10**3,
  "mb": 10**6,
  "gb": 10**9,
  "tb": 10**12,
  "kib": 2**10,
  "mib": 2**20,
  "gib": 2**30,
  "tib": 2**40,
}
# What `render` and the JSON output show of a model's config.
SHOWN_FIELDS = (
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "d_model",
  "mlp_dim",
  "vocab_size",
  "window",
  "sink_tokens",
  "kv_latent_rank",
  "rope_dims",
)


def parse_bytes(text: str) -> int:
  """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '1.5e9' -> 1500000000."""
  match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
  size = float(match.group(1)) * UNITS[match.group(2)] if match and match.group(2) in UNITS else math.nan
  if not math.isfinite(size):
    raise ValueError(f"cannot read memory size {text!r}; use e.g. 80GB, 141GB, 24GiB or a byte count")
  return int(size)


# The variants: each a ModelConfig.


def kv_head_counts(config: ModelConfig) -> list[int]:
  """Every kv-head count the query heads can be grouped into, MHA first, MQA last."""
  return [k for k in range(config.num_heads, 0, -1) if config.num_heads % k == 0]


def variant_name(config: ModelConfig, num_kv_heads: int) -> str:
  return "MHA" if num_kv_heads == config.num_heads else "MQA" if num_kv_heads == 1 else "GQA"


def kv_variant(config: ModelConfig, num_kv_heads: int) -> ModelConfig:
  """`config` with num_kv_heads kv heads and a K/V cache (an MLA model's latent dropped)."""
  return config.replace(num_kv_heads=num_kv_heads, kv_latent_rank=0, rope_dims=0, rope_pairs=None)


def mla_variant(config: ModelConfig, rank: int, rope_dims: int) -> ModelConfig:
  """`config` with multi-head latent attention caching a latent of `rank` and a rotary key of
  rope_dims per token (kvjax.model.mla). Its positions are RoPE when rope_dims > 0 and learned
  otherwise (kvjax's MLA rotates only the rotary key); num_kv_heads, which MLA reads as the
  rotary key's groups, stays the model's where rope_dims splits into that many groups, else is
  the fewest that it splits into. ValueError naming the variant when no such model exists."""
  check_positive_int(rank, "MLA latent rank")
  if isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or rope_dims < 0:
    raise ValueError(f"MLA rope dims must be a non-negative integer, got {rope_dims!r}")
  splits = lambda k: rope_dims % (2 * k) == 0 and rope_dims // k <= config.head_dim
  groups = next((k for k in [config.num_kv_heads, *kv_head_counts(config)[::-1]] if splits(k)), config.num_kv_heads)
  positions = "rope" if rope_dims else "learned"
  try:
    return config.replace(
      kv_latent_rank=rank,
      rope_dims=rope_dims,
      rope_pairs=None,
      num_kv_heads=groups,
      positions=positions,
      rope_scaling=config.rope_scaling if rope_dims else None,
    )
  except ValueError as e:
    raise ValueError(f"no MLA variant {rank}+{rope_dims} of this model: {e}") from None


def device_share(config: ModelConfig, devices: int) -> ModelConfig:
  """The model whose cache is the part of `config`'s that one of `devices` holds under kvjax's
  tensor parallelism (kvjax.sharding: the cache's kv-head axis on the model axis): kv heads /
  devices kv heads, with their query heads, when they divide; otherwise the whole cache, which
  kvjax replicates, as it does an MLA cache (its one latent is every head's)."""
  if config.is_latent or config.num_kv_heads % devices:
    return config
  kv = config.num_kv_heads // devices
  return config.replace(num_heads=kv * config.q_per_kv, num_kv_heads=kv)


# What fits: the kinds' sizes searched.


def largest(fits: Callable[[int], bool]) -> int:
  """The largest n >= 0 with fits(n), for a fits true up to some n and false past it (0 counts as
  fitting)."""
  low, high = 0, 1  # fits(low); grow high until it does not, then bisect
  while fits(high):
    low, high = high, 2 * high
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low


def growth_bound(config: ModelConfig, cache_config: CacheConfig) -> int | None:
  """The length past which the cache kind keeps no more positions of a sequence (a contiguous
  cache whose every layer is windowed: widest window + sinks), None when it grows with it."""
  model = cache_config.model(config)
  longest = max(model.window, default=0) + model.sink_tokens
  size = lambda n: kinds.sequence_bytes(config, cache_config, n)
  return longest if longest and size(longest + 1) == size(longest) else None


def max_batch(config: ModelConfig, cache_config: CacheConfig, context: int, free: int) -> int:
  """The most sequences of `context` tokens whose cache fits `free` bytes."""
  return largest(lambda b: kinds.cache_bytes(config, cache_config, b, context) <= free)


def max_context(config: ModelConfig, cache_config: CacheConfig, batch: int, free: int) -> int | None:
  """The longest context whose cache for `batch` sequences fits `free` bytes; None when the cache
  stops growing (`growth_bound`) at a size that fits (any context does)."""
  fits = lambda n: kinds.cache_bytes(config, cache_config, batch, n) <= free
  bound = growth_bound(config, cache_config)
  return None if bound is not None and fits(bound) else largest(fits)


def plan(
  arch: Architecture,
  *,
  context: int,
  batch: int,
  dtype: str = "bf16",
  weight_dtype: str | None = None,
  device_memory: int | None = None,
  devices: int = 1,
  mla: tuple[tuple[int, int], ...] = (),
  layout: str = "contiguous",
  page_size: int = CacheConfig.page_size,
) -> dict:
  """Bytes per token, cache size and what fits, for the model, each kv-head variant and the MLA
  variants `mla` ((kv_latent_rank, rope_dims) pairs), in a cache of CacheConfig(layout, dtype,
  page_size).

  bytes_per_token counts every layer at every position; cache_bytes is what the kind allocates
  for `batch` sequences of `context` tokens (kinds.cache_bytes), and what fits is searched on it.
  max_context is None where any context fits (`growth_bound`).

  With devices > 1 the weights are split evenly across them and each device holds the cache of
  `device_share`: its kv heads (tensor parallel), or all of an MLA cache.
  """
  for name, value in (("context", context), ("batch", batch), ("devices", devices)):
    check_positive_int(value, name)
  if dtype not in DTYPE_NAMES:
    raise ValueError(f"dtype {dtype!r} is not one of {DTYPE_NAMES}")
  cache_config = CacheConfig(layout=layout, dtype=dtype, page_size=page_size)
  weight_dtype = weight_dtype or (dtype if dtype in BYTES_PER_ELEMENT else "bf16")
  if weight_dtype not in BYTES_PER_ELEMENT:
    raise ValueError(f"weight dtype {weight_dtype!r} is not one of {tuple(BYTES_PER_ELEMENT)}")
  weights = arch.params * BYTES_PER_ELEMENT[weight_dtype]
  free = None if device_memory is None else max(device_memory - -(-weights // devices), 0)
  config = arch.config
  variants = []  # (row, ModelConfig)
  for rank, rope_dims in ([(config.kv_latent_rank, config.rope_dims)] if config.is_latent else []) + list(mla):
    as_built = config.is_latent and not variants
    variant = config if as_built else mla_variant(config, rank, rope_dims)
    variants.append(
      (
        {
          "variant": f"MLA {rank}+{rope_dims}",
          "kv_heads": variant.num_kv_heads,
          "kv_latent_rank": rank,
          "rope_dims": rope_dims,
          "as_built": as_built,
        },
        variant,
      )
    )
  for kv in kv_head_counts(config):
    as_built = kv == config.num_kv_heads and not config.is_latent
    variants.append(
      (
        {"variant": variant_name(config, kv), "kv_heads": kv, "as_built": as_built},
        config if as_built else kv_variant(config, kv),
      )
    )
  rows = []
  for row, variant in variants:
    row["bytes_per_token"] = kinds.bytes_per_token(variant, cache_config)
    row["cache_bytes"] = kinds.cache_bytes(variant, cache_config, batch, context)
    if free is not None:
      share = device_share(variant, devices)
      row["max_batch"] = max_batch(share, cache_config, context, free)
      row["max_context"] = max_context(share, cache_config, batch, free)
    rows.append(row)
  built = next(r for r in rows if r["as_built"])
  result = {
    "model": arch.name,
    "architecture": describe(arch),
    "dtype": dtype,
    "layout": layout,
    "weight_dtype": weight_dtype,
    "context": context,
    "batch": batch,
    "bytes_per_token": built["bytes_per_token"],
    "cache_bytes": built["cache_bytes"],
    "weights_bytes": weights,
    "variants": rows,
  }
  if layout == "paged":
    result["page_size"] = page_size
  if device_memory is not None:
    result.update(
      devices=devices,
      device_memory_bytes=device_memory,
      free_bytes_per_device=free,
      max_batch=built["max_batch"],
      max_context=built["max_context"],
    )
  return result


def describe(arch: Architecture) -> dict:
  """The model's name, SHOWN_FIELDS of its config, params and note: plain JSON types."""
  shown = {name: getattr(arch.config, name) for name in SHOWN_FIELDS}
  return {"name": arch.name, **shown, "window": list(arch.config.window), "params": arch.params, "note": arch.note}


def human(n: int) -> str:
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n} B"


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def render(result: dict) -> str:
  a = result["architecture"]
  paged = result["layout"] == "paged"
  lines = [
    f"{result['model']}: {a['num_layers']} layers, {a['num_heads']} query heads, "
    f"{a['num_kv_heads']} kv heads, head dim {a['head_dim']}, d_model {a['d_model']}, "
    f"{_count(a['params'])} params"
  ]
  if a["kv_latent_rank"]:
    lines.append(f"multi-head latent attention: latent rank {a['kv_latent_rank']}, {a['rope_dims']} rotary dims")
  if a["note"]:
    lines.append(f"  ({a['note']})")
  if any(a["window"]):
    kept = "a paged cache keeps every position" if paged else "windowed layers keep at most window + sinks positions"
    lines.append(
      f"sliding windows {tuple(a['window'])} repeated over the layers (0 = global), "
      f"{a['sink_tokens']} sink tokens: {kept}"
    )
  lines.append(f"weights ({result['weight_dtype']}): {human(result['weights_bytes'])}")
  fits = "device_memory_bytes" in result
  if fits:
    memory = result["device_memory_bytes"]
    lines.append(
      f"{result['devices']} device(s) of {memory / 1e9:.1f} GB ({human(memory)}): "
      f"{human(result['free_bytes_per_device'])} free per device after weights"
    )
    if not result["free_bytes_per_device"]:
      lines.append("  the weights alone do not fit: add devices or use a smaller --weight-dtype")
  header = f"  {'variant':<13}{'kv heads':>9}{'per token':>12}{'cache':>12}"
  header += f"{'max batch':>11}{'max context':>13}" if fits else ""
  pages = f", {result['page_size']}-token pages" if paged else ""
  lines += [
    f"KV cache in {result['dtype']}{pages}, context {result['context']:,} x batch {result['batch']:,} (* = as built):",
    header,
  ]
  for row in result["variants"]:
    line = (
      f"{'*' if row['as_built'] else ' '} {row['variant']:<13}{row['kv_heads']:>9}"
      f"{human(row['bytes_per_token']):>12}{human(row['cache_bytes']):>12}"
    )
    if fits:
      most = "unbounded" if row["max_context"] is None else f"{row['max_context']:,}"
      line += f"{row['max_batch']:>11,}{most:>13}"
    lines.append(line)
  return "\n".join(lines)
