"""KV-cache size planner: `kvjax kv-size MODEL [--context N] [--batch B] [--dtype bf16] ...`.

A cache holds K and V for every layer, kv head and position, so one token costs
  2 x num_layers x num_kv_heads x bytes per head,
where a head's K (or V) takes head_dim x bytes per element in a float cache and, in a quantized
one (kvjax.cache.quant), its values and float32 scales: head_dim + 4 bytes in int8 or fp8,
head_dim / 2 + 4 x head_dim / group in int4 (kvjax.config.cache_bytes_per_head). A batch of B
sequences of N tokens costs B x N times that, except that a sliding-window layer keeps at most
window + sinks positions (kvjax.config.cached_positions), so its share stops growing there and a
model whose every layer is windowed fits any context. A multi-head latent attention (MLA) model
caches a latent of kv_latent_rank and a rotary key of rope_dims per layer instead:
  num_layers x (kv_latent_rank + rope_dims) x bytes per element, whatever the number of heads
(float caches only: kvjax builds no quantized latent cache); `--mla RANK:ROPE_DIMS` adds such a
variant of any model to the table. The planner prints this for
the model as built and for its MHA / GQA / MQA variants (every kv-head count that divides
the query heads), and how large a batch or context fits the device memory once the weights
are loaded, optionally split across several devices. Activations and framework overhead are
not counted.

MODEL is a preset name (PRESETS), a kvjax config file (get_config() returning a ModelConfig
or a config with a .model ModelConfig), a kvjax workdir, or a Hugging Face directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

from kvjax.config import DTYPES, ModelConfig, cached_positions
from kvjax.fields import CACHE_DTYPES, cache_bytes_per_head, cache_stored_dtype, check_nonnegative, check_positive, check_positive_int, from_dict
from kvjax.interop.hf_files import read_hf_config
from kvjax.interop.gguf_file import is_gguf
from kvjax.interop.importer import NAMED_MODELS, config_from_hf, read_config
from kvjax.model.params import abstract_params

# Weight element types.
BYTES_PER_ELEMENT = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
                     "fp8": 1, "int8": 1}
# Cache formats: ModelConfig.cache_dtype's names and their short forms.
CACHE_DTYPE_NAMES = {**{name: name for name in CACHE_DTYPES}, "fp32": "float32", "bf16": "bfloat16",
                     "fp16": "float16", "fp8": "float8_e4m3fn"}
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclasses.dataclass(frozen=True)
class Architecture:
  """What the KV cache and the weights' size depend on. params counts every weight; window and
  sink_tokens are ModelConfig's (a per-layer pattern of sliding-window widths, 0 = global)."""

  name: str
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_model: int
  mlp_dim: int
  vocab_size: int
  params: int
  note: str = ""
  window: tuple[int, ...] = ()
  sink_tokens: int = 0
  kv_latent_rank: int = 0  # > 0: multi-head latent attention (ModelConfig.kv_latent_rank)
  rope_dims: int = 0

  def __post_init__(self):
    check_positive(self, "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_model",
                   "mlp_dim", "vocab_size", "params")
    check_nonnegative(self, "sink_tokens")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in self.window):
      raise ValueError(f"Architecture.window must hold non-negative integers, got {self.window!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"Architecture.num_heads={self.num_heads} is not divisible by "
                       f"num_kv_heads={self.num_kv_heads}")

  def bytes_per_token(self, cache_dtype: str, num_kv_heads: int | None = None,
                      latent: tuple[int, int] | None = None) -> int:
    """Cache bytes of one token at every layer in `cache_dtype` (a CACHE_DTYPE_NAMES key), scales
    included (what a cache without sliding windows pays per token), of the model as built, of its
    variant with num_kv_heads kv heads (a K/V cache), or of its MLA variant latent=(kv_latent_rank,
    rope_dims)."""
    return self.num_layers * self.position_bytes(cache_dtype, num_kv_heads, latent)

  def position_bytes(self, cache_dtype: str, num_kv_heads: int | None = None,
                     latent: tuple[int, int] | None = None) -> int:
    """Bytes one layer keeps per cached position (see bytes_per_token for the arguments): an MLA
    layer's latent and rotary key, or a K/V layer's kv heads. ValueError for a quantized latent."""
    if latent is None and num_kv_heads is None and self.kv_latent_rank:
      latent = (self.kv_latent_rank, self.rope_dims)
    if latent is not None:
      name = CACHE_DTYPE_NAMES[cache_dtype]
      if name not in DTYPES:
        raise ValueError(f"an MLA cache in {cache_dtype!r}: kvjax stores latent caches in float dtypes only "
                         f"({', '.join(DTYPES)})")
      return sum(latent) * cache_stored_dtype(name).itemsize
    kv = self.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * kv * cache_bytes_per_head(CACHE_DTYPE_NAMES[cache_dtype], self.head_dim)

  def layer_window(self, layer: int) -> int:
    return self.window[layer % len(self.window)] if self.window else 0

  def cached_positions(self, context: int) -> int:
    """Positions of one sequence of `context` tokens the cache keeps, summed over the layers."""
    return sum(cached_positions(self.layer_window(i), self.sink_tokens, context) for i in range(self.num_layers))

  def sequence_bytes(self, context: int, cache_dtype: str, num_kv_heads: int | None = None,
                     latent: tuple[int, int] | None = None) -> int:
    """Cache bytes of one sequence of `context` tokens in `cache_dtype`, scales included, each
    windowed layer at most window + sinks positions."""
    return self.position_bytes(cache_dtype, num_kv_heads, latent) * self.cached_positions(context)

  def max_context(self, free: int, batch: int, cache_dtype: str, num_kv_heads: int | None = None,
                  latent: tuple[int, int] | None = None) -> int | None:
    """The longest context whose cache for `batch` sequences fits `free` bytes; None when every
    layer is windowed and the cache's largest size fits (any context does)."""
    fits = lambda n: batch * self.sequence_bytes(n, cache_dtype, num_kv_heads, latent) <= free
    if all(self.layer_window(i) for i in range(self.num_layers)):
      if fits(max(self.window) + self.sink_tokens):
        return None
    low, high = 0, 1  # fits(low); grow high until it does not, then bisect
    while fits(high):
      low, high = high, 2 * high
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# Published architectures (config.json of each release; params as reported for the checkpoint).
PRESETS = {p.name: p for p in (
    Architecture("Qwen2-0.5B", 24, 14, 2, 64, 896, 4864, 151936, 494_032_768),
    Architecture("Qwen2-1.5B", 28, 12, 2, 128, 1536, 8960, 151936, 1_543_714_304),
    Architecture("Qwen2-7B", 28, 28, 4, 128, 3584, 18944, 152064, 7_615_616_512),
    Architecture("Qwen2-57B-A14B", 28, 28, 4, 128, 3584, 2560, 151936, 57_408_658_944,
                 note="mixture of experts: 64 experts of mlp_dim 2560 plus a shared one; "
                      "all 57.4B weights are resident, 14B active per token"),
    Architecture("Qwen2-72B", 80, 64, 8, 128, 8192, 29568, 152064, 72_706_203_648),
    Architecture("Llama-2-70B", 80, 64, 8, 128, 8192, 28672, 32000, 68_976_648_192),
    Architecture("Llama-3-70B", 80, 64, 8, 128, 8192, 28672, 128256, 70_553_706_496),
    Architecture("GPT-2", 12, 12, 12, 64, 768, 3072, 50257, 124_439_808),
    Architecture("Mistral-7B-v0.1", 32, 32, 8, 128, 4096, 14336, 32000, 7_241_732_096,
                 note="sliding window of 4096 on every layer (v0.1; later versions attend globally)",
                 window=(4096,)),
    Architecture("Gemma-2-9B", 42, 16, 8, 256, 3584, 14336, 256000, 9_241_705_984,
                 note="local layers (window 4096) alternate with global ones", window=(4096, 0)),
    Architecture("T5.1.1-XXL-decoder", 24, 64, 64, 64, 4096, 10240, 32128, 11_135_332_352,
                 note="cache of the decoder's self-attention; cross-attention adds as much per "
                      "encoder token. Weights count encoder and decoder"),
)}


def count_params(config: ModelConfig) -> int:
  """Weights of Transformer(config), from the shapes of a one- and a two-layer model: every
  layer has the same parameters, and tracing 80 layers would take seconds."""
  one, two = (sum(math.prod(x.shape) for x in _leaves(abstract_params(config.replace(num_layers=n))))
              for n in (1, 2))
  return one + (config.num_layers - 1) * (two - one)


def _leaves(tree):
  for value in tree.values():
    yield from (_leaves(value) if isinstance(value, dict) else (value,))


def from_model_config(name: str, config: ModelConfig) -> Architecture:
  return Architecture(name, config.num_layers, config.num_heads, config.num_kv_heads,
                      config.head_dim, config.d_model, config.mlp_dim, config.vocab_size,
                      count_params(config), window=config.window, sink_tokens=config.sink_tokens,
                      kv_latent_rank=config.kv_latent_rank, rope_dims=config.rope_dims)


def _model_config_from_file(path: Path) -> ModelConfig:
  spec = importlib.util.spec_from_file_location(f"kvjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path} does not define get_config()")
  config = module.get_config()
  config = config if isinstance(config, ModelConfig) else getattr(config, "model", None)
  if not isinstance(config, ModelConfig):
    raise ValueError(f"get_config() in {path} returns neither a ModelConfig nor a config with a "
                     ".model ModelConfig")
  return config


def _model_config_from_workdir(path: Path) -> ModelConfig:
  """The model of a workdir's config.json, which `kvjax run`, uptrain and import-hf all write."""
  saved = path / "config.json"
  if not saved.is_file():
    raise ValueError(f"{path} holds checkpoints but no config.json naming their model (a workdir "
                     "written before kvjax recorded one); pass the run's config file instead")
  model = json.loads(saved.read_text()).get("model")
  if not isinstance(model, dict):
    raise ValueError(f"{path} holds no kvjax model config (no 'model' section)")
  return from_dict(ModelConfig, model)


def resolve(spec: str) -> Architecture:
  """A preset name (case-insensitive), a named pretrained model (smollm2-135m), a GGUF file, a
  config file, a kvjax workdir or a Hugging Face directory."""
  by_lower = {name.lower(): arch for name, arch in PRESETS.items()}
  if spec.lower() in by_lower:
    return by_lower[spec.lower()]
  path = Path(spec)
  if spec in NAMED_MODELS or (path.is_file() and is_gguf(path)):
    return from_model_config(path.name, read_config(spec))
  if path.is_file() and path.suffix == ".py":
    return from_model_config(path.name, _model_config_from_file(path))
  if path.is_dir():
    if (path / "config.json").is_file():
      if "model_type" in json.loads((path / "config.json").read_text()):
        return from_model_config(path.name, config_from_hf(read_hf_config(path)))
    if (path / "config.json").is_file() or (path / "checkpoints").is_dir():
      return from_model_config(path.name, _model_config_from_workdir(path))
  raise ValueError(f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}), a named model "
                   f"({', '.join(NAMED_MODELS)}), a GGUF file, a config file (.py), a kvjax workdir or a Hugging "
                   "Face directory")


def parse_bytes(text: str) -> int:
  """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '1.5e9' -> 1500000000."""
  match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
  if not match or match.group(2) not in UNITS:
    raise ValueError(f"cannot read memory size {text!r}; use e.g. 80GB, 141GB, 24GiB or a byte count")
  return int(float(match.group(1)) * UNITS[match.group(2)])


def kv_head_counts(arch: Architecture) -> list[int]:
  """Every kv-head count the query heads can be grouped into, MHA first, MQA last."""
  return [k for k in range(arch.num_heads, 0, -1) if arch.num_heads % k == 0]


def variant_name(arch: Architecture, num_kv_heads: int) -> str:
  return "MHA" if num_kv_heads == arch.num_heads else "MQA" if num_kv_heads == 1 else "GQA"


def plan(arch: Architecture, *, context: int, batch: int, dtype: str = "bf16",
         weight_dtype: str | None = None, device_memory: int | None = None, devices: int = 1,
         mla: tuple[tuple[int, int], ...] = ()) -> dict:
  """Bytes per token, cache size and what fits, for the model, each kv-head variant and the MLA
  variants `mla` ((kv_latent_rank, rope_dims) pairs).

  An MLA cache is not split across devices (its latent is shared by all heads): each device
  holds all of it.

  bytes_per_token counts every layer; cache_bytes and what fits count each windowed layer at
  most window + sinks positions. max_context is None where any context fits (every layer windowed).

  With devices > 1 the weights and kv heads are split across them (tensor parallel); a model
  with fewer kv heads than devices keeps one kv head per device, replicated (vLLM's rule),
  so each device stores ceil(kv_heads / devices) heads of every token.
  """
  for name, value in (("context", context), ("batch", batch), ("devices", devices)):
    check_positive_int(value, name)
  if dtype not in CACHE_DTYPE_NAMES:
    raise ValueError(f"dtype {dtype!r} is not one of {tuple(CACHE_DTYPE_NAMES)}")
  weight_dtype = weight_dtype or (dtype if dtype in BYTES_PER_ELEMENT else "bf16")
  if weight_dtype not in BYTES_PER_ELEMENT:
    raise ValueError(f"weight dtype {weight_dtype!r} is not one of {tuple(BYTES_PER_ELEMENT)}")
  weights = arch.params * BYTES_PER_ELEMENT[weight_dtype]
  free = None if device_memory is None else max(device_memory - -(-weights // devices), 0)
  for rank, rope_dims in mla:
    check_positive_int(rank, "MLA latent rank")
    if rope_dims < 0:
      raise ValueError(f"MLA rope dims must be non-negative, got {rope_dims}")
  rows = []

  def add(row, per_device_kv, latent=None):
    row["cache_bytes"] = arch.sequence_bytes(context, dtype, row["kv_heads"], latent) * batch
    if free is not None:
      row["max_batch"] = free // arch.sequence_bytes(context, dtype, per_device_kv, latent)
      row["max_context"] = arch.max_context(free, batch, dtype, per_device_kv, latent)
    rows.append(row)

  latents = ([(arch.kv_latent_rank, arch.rope_dims)] if arch.kv_latent_rank else []) + list(mla)
  for i, (rank, rope_dims) in enumerate(latents):
    add({"variant": f"MLA {rank}+{rope_dims}", "kv_heads": arch.num_kv_heads, "kv_latent_rank": rank,
         "rope_dims": rope_dims, "as_built": i == 0 and bool(arch.kv_latent_rank),
         "bytes_per_token": arch.bytes_per_token(dtype, latent=(rank, rope_dims))},
        None, (rank, rope_dims))
  for kv in kv_head_counts(arch):
    add({"variant": variant_name(arch, kv), "kv_heads": kv, "as_built": kv == arch.num_kv_heads and not arch.kv_latent_rank,
         "bytes_per_token": arch.bytes_per_token(dtype, kv)}, -(-kv // devices))
  result = {"model": arch.name, "architecture": dataclasses.asdict(arch), "dtype": dtype,
            "weight_dtype": weight_dtype, "context": context, "batch": batch,
            "bytes_per_token": arch.bytes_per_token(dtype),
            "cache_bytes": arch.sequence_bytes(context, dtype) * batch,
            "weights_bytes": weights, "variants": rows}
  if device_memory is not None:
    built = next(r for r in rows if r["as_built"])
    result.update(devices=devices, device_memory_bytes=device_memory, free_bytes_per_device=free,
                  max_batch=built["max_batch"], max_context=built["max_context"])
  return result


def human(n: int) -> str:
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n} B"


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def render(result: dict) -> str:
  a = result["architecture"]
  lines = [f"{result['model']}: {a['num_layers']} layers, {a['num_heads']} query heads, "
           f"{a['num_kv_heads']} kv heads, head dim {a['head_dim']}, d_model {a['d_model']}, "
           f"{_count(a['params'])} params"]
  if a["note"]:
    lines.append(f"  ({a['note']})")
  if any(a["window"]):
    lines.append(f"sliding windows {tuple(a['window'])} repeated over the layers (0 = global), "
                 f"{a['sink_tokens']} sink tokens: windowed layers keep at most window + sinks positions")
  lines.append(f"weights ({result['weight_dtype']}): {human(result['weights_bytes'])}")
  fits = "device_memory_bytes" in result
  if fits:
    memory = result["device_memory_bytes"]
    lines.append(f"{result['devices']} device(s) of {memory / 1e9:.1f} GB ({human(memory)}): "
                 f"{human(result['free_bytes_per_device'])} free per device after weights")
    if not result["free_bytes_per_device"]:
      lines.append("  the weights alone do not fit: add devices or use a smaller --weight-dtype")
  header = f"  {'variant':<13}{'kv heads':>9}{'per token':>12}{'cache':>12}"
  header += f"{'max batch':>11}{'max context':>13}" if fits else ""
  lines += [f"KV cache in {result['dtype']}, context {result['context']:,} x batch {result['batch']:,} "
            "(* = as built):", header]
  for row in result["variants"]:
    line = (f"{'*' if row['as_built'] else ' '} {row['variant']:<13}{row['kv_heads']:>9}"
            f"{human(row['bytes_per_token']):>12}{human(row['cache_bytes']):>12}")
    if fits:
      most = "unbounded" if row["max_context"] is None else f"{row['max_context']:,}"
      line += f"{row['max_batch']:>11,}{most:>13}"
    lines.append(line)
  return "\n".join(lines)
