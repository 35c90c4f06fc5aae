"""The models the KV-cache planner (kvjax.interop.kv_size) sizes: an `Architecture` is a
ModelConfig, the number of its weights and a note.

`PRESETS` are published architectures, each with its released weight count (those of a family
kvjax imports read from their config.json keys through the family entry); `resolve(spec)`
names one of them, or reads any other model from a named pretrained model, a GGUF file, a kvjax
config file (get_config() returning a ModelConfig or a config with a .model ModelConfig), a kvjax
workdir or a Hugging Face directory, counting its weights with param_count.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int, from_dict
from kvjax.interop.gguf_file import is_gguf
from kvjax.interop.hf_files import read_hf_config
from kvjax.interop.importer import NAMED_MODELS, config_from_hf, read_config
from kvjax.model.params import param_count

# The max_len of the presets with RoPE: long enough for any window they have. It is not the
# context they were released with; the planner sizes any context.
PRESET_MAX_LEN = 2**20


@dataclasses.dataclass(frozen=True)
class Architecture:
  """A model to plan for. config: its network, which every cache size comes from; params: every
  weight it has (the published figure of a preset, param_count of any other model); note: what
  the config leaves out (experts, an encoder, ...)."""

  name: str
  config: ModelConfig
  params: int
  note: str = ""

  def __post_init__(self):
    if not isinstance(self.config, ModelConfig):
      raise ValueError(f"Architecture.config must be a ModelConfig, got {self.config!r}")
    check_positive_int(self.params, "Architecture.params")


def _released(name: str, params: int, hf: dict, note: str = "", **beyond) -> Architecture:
  """A published model from the config.json keys of its release that size it, read through its
  family's entry as `kvjax import` reads them (kvjax.interop.importer.config_from_hf), so the
  family, not this table, says what it has (biases, norms, positions, tied embeddings where the
  family defaults to them). A RoPE model's max_position_embeddings is PRESET_MAX_LEN unless
  given. beyond: ModelConfig fields the family entry does not read (Mistral's sliding window, which
  import refuses)."""
  config = config_from_hf({"max_position_embeddings": PRESET_MAX_LEN, **hf}, dtype="float32")
  return Architecture(name, config.replace(**beyond), params, note)


def _preset(
  name: str,
  num_layers: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  d_model: int,
  mlp_dim: int,
  vocab_size: int,
  params: int,
  note: str = "",
  **traits,
) -> Architecture:
  """A published model of no family kvjax imports, its ModelConfig written out here."""
  config = ModelConfig(
    vocab_size=vocab_size,
    d_model=d_model,
    num_layers=num_layers,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    mlp_dim=mlp_dim,
    **{"max_len": PRESET_MAX_LEN, **traits},
  )
  return Architecture(name, config, params, note)


def _llama_like(
  model_type: str, layers: int, heads: int, kv_heads: int, d_model: int, mlp_dim: int, vocab: int, **more
):
  """The config.json keys that size a Llama-family or Qwen2 release (head_dim is d_model / heads in each)."""
  return {
    "model_type": model_type,
    "num_hidden_layers": layers,
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "hidden_size": d_model,
    "intermediate_size": mlp_dim,
    "vocab_size": vocab,
    **more,
  }


# Published architectures (config.json of each release; params as reported for the checkpoint).
# A preset of a family kvjax imports is its config.json keys read through the family's entry, so
# a dense preset's param_count equals its params; rope_theta and norm_eps are left to the
# family's defaults (no size depends on them). Gemma 2, Gemma 3 (read from GGUF only) and T5 are
# written out as ModelConfigs.
PRESETS = {
  p.name: p
  for p in (
    _released("Qwen2-0.5B", 494_032_768, _llama_like("qwen2", 24, 14, 2, 896, 4864, 151936, tie_word_embeddings=True)),
    _released(
      "Qwen2-1.5B", 1_543_714_304, _llama_like("qwen2", 28, 12, 2, 1536, 8960, 151936, tie_word_embeddings=True)
    ),
    _released("Qwen2-7B", 7_615_616_512, _llama_like("qwen2", 28, 28, 4, 3584, 18944, 152064)),
    _released(
      "Qwen2-57B-A14B",
      57_408_658_944,
      # Its config.json is model_type qwen2_moe; its attention, which sizes the cache, is Qwen2's.
      _llama_like("qwen2", 28, 28, 4, 3584, 2560, 151936),
      note="mixture of experts: 64 experts of mlp_dim 2560 plus a shared one; "
      "all 57.4B weights are resident, 14B active per token",
    ),
    _released("Qwen2-72B", 72_706_203_648, _llama_like("qwen2", 80, 64, 8, 8192, 29568, 152064)),
    _released("Llama-2-70B", 68_976_648_192, _llama_like("llama", 80, 64, 8, 8192, 28672, 32000)),
    _released("Llama-3-70B", 70_553_706_496, _llama_like("llama", 80, 64, 8, 8192, 28672, 128256)),
    _released(
      "GPT-2",
      124_439_808,
      {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "n_positions": 1024},
    ),
    _released(
      "Mistral-7B-v0.1",
      7_241_732_096,
      _llama_like("mistral", 32, 32, 8, 4096, 14336, 32000),
      note="sliding window of 4096 on every layer (v0.1; later versions attend globally)",
      window=(4096,),
    ),
    _preset(
      "Gemma-2-9B",
      42,
      16,
      8,
      256,
      3584,
      14336,
      256000,
      9_241_705_984,
      note="local layers (window 4096) alternate with global ones; logit soft-capping, which sizes nothing, left out",
      window=(4096, 0),
      tie_embeddings=True,
      activation="geglu",
      post_norms=True,
      scale_embeddings=True,
    ),
    _preset(
      "Gemma-3-270M",
      18,
      4,
      1,
      256,
      640,
      2048,
      262144,
      268_098_176,
      note="five local layers (window 512, RoPE base 10,000) to one global; the gemma3-270m named model",
      window=(512,) * 5 + (0,),
      tie_embeddings=True,
      activation="geglu",
      qk_norm=True,
      post_norms=True,
      scale_embeddings=True,
      rope_theta=1_000_000.0,
      rope_local_theta=10_000.0,
    ),
    _preset(
      "T5.1.1-XXL-decoder",
      24,
      64,
      64,
      64,
      4096,
      10240,
      32128,
      11_135_332_352,
      note="cache of the decoder's self-attention; cross-attention adds as much per "
      "encoder token. Weights count encoder and decoder",
    ),
  )
}


def from_model_config(name: str, config: ModelConfig) -> Architecture:
  """Any model but a preset: its weights counted by param_count."""
  return Architecture(name, config, param_count(config))


def _model_config_from_file(path: Path) -> ModelConfig:
  spec = importlib.util.spec_from_file_location(f"kvjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as err:
    raise ValueError(f"config file {path} is not valid Python: {err.msg} (line {err.lineno})") from None
  except (UnicodeDecodeError, ValueError) as err:
    raise ValueError(f"config file {path} is not a readable Python file: {err}") from None
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path} does not define get_config()")
  config = module.get_config()
  config = config if isinstance(config, ModelConfig) else getattr(config, "model", None)
  if not isinstance(config, ModelConfig):
    raise ValueError(f"get_config() in {path} returns neither a ModelConfig nor a config with a .model ModelConfig")
  return config


def _model_config_from_workdir(path: Path) -> ModelConfig:
  """The model of a workdir's config.json, which `kvjax run`, uptrain and import-hf all write."""
  saved = path / "config.json"
  if not saved.is_file():
    raise ValueError(
      f"{path} holds checkpoints but no config.json naming their model (a workdir "
      "written before kvjax recorded one); pass the run's config file instead"
    )
  model = read_hf_config(path).get("model")  # config.json parsed, or refused naming the file
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
      if "model_type" in read_hf_config(path):
        return from_model_config(path.name, config_from_hf(read_hf_config(path)))
    if (path / "config.json").is_file() or (path / "checkpoints").is_dir():
      return from_model_config(path.name, _model_config_from_workdir(path))
  raise ValueError(
    f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}), a named model "
    f"({', '.join(NAMED_MODELS)}), a GGUF file, a config file (.py), a kvjax workdir or a Hugging "
    "Face directory"
  )
