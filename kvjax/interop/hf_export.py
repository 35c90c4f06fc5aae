"""Hugging Face export: (kvjax params, ModelConfig) -> a config.json + model.safetensors directory
that `transformers` loads (`kvjax export-hf`), the inverse of import from the same family entries
(kvjax.interop.families.FAMILIES).

Which family: each entry's `config_to_hf` writes its config.json keys, which its `config_from_hf`
reads back; a family holds the model when what comes back is the model's config, except that
biases may be added (written as zeros, which computes the same function) or dropped where they
are all zero, and that rope_theta does not matter without RoPE. A family that gives the config back
exactly is preferred (a model with q/k/v biases alone is Qwen2, not a Llama with zero output
biases); a model no family holds is refused with each family's reason.

Which tensors: the family's `tensors` plan for the config read back, each written by undoing what
import does with it (`kvjax.interop.family.write`: transposes, reshapes, fused q/k/v joined).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from kvjax.config import ModelConfig
from kvjax.interop.families import FAMILIES
from kvjax.interop.family import Family, Tensor, write
from kvjax.interop.hf_files import TOKENIZER_FILE
from kvjax.interop.importer import flatten
from kvjax.model.params import abstract_params

WEIGHTS_FILE = "model.safetensors"
# Bias flags a family may add (as zeros) or drop (when all zero) without changing the function.
BIAS_FIELDS = ("qkv_bias", "use_bias")


@dataclasses.dataclass(frozen=True)
class Export:
  """How a model is written: its family, config.json, the config import reads back from it, and
  the plan of the tensors written."""

  family: Family
  hf: dict
  config: ModelConfig
  plan: list[Tensor]


def _attempt(family: Family, config: ModelConfig, params: dict) -> Export:
  """The model written as `family`; ValueError saying what the family cannot hold."""
  hf = {
    "architectures": [family.hf_architecture],
    "model_type": family.hf_model_types[0],
    **family.config_to_hf(config, params),
    "torch_dtype": config.dtype,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
  }
  back = family.config_from_hf(hf, config.dtype)
  ignored = BIAS_FIELDS + (("rope_theta",) if config.positions != "rope" else ())
  unlike = [
    f"{f.name}={getattr(config, f.name)!r} (its models have {getattr(back, f.name)!r})"
    for f in dataclasses.fields(ModelConfig)
    if f.name not in ignored and getattr(config, f.name) != getattr(back, f.name)
  ]
  if unlike:
    raise ValueError(f"it cannot hold {', '.join(unlike)}")
  plan = [t for t in family.tensors(back, set()) if t.when is None or hf.get(t.when)]
  written = {t.path for t in plan}
  dropped = [path for path, value in flatten(params).items() if path not in written and np.any(np.asarray(value))]
  if dropped:
    raise ValueError(f"it has no tensor for the nonzero {'/'.join(dropped[0])}")
  return Export(family, hf, back, plan)


def plan_export(config: ModelConfig, params: dict) -> Export:
  """The family that holds the model and how it is written; ValueError naming, for each family,
  what it cannot hold, or the parameter `params` lack."""
  missing = sorted(set(flatten(abstract_params(config))) - set(flatten(params)))
  if missing:
    raise ValueError(f"params have no {'/'.join(missing[0])}, which the model config implies")
  held, reasons = [], []
  for family in FAMILIES:
    try:
      held.append(_attempt(family, config, params))
    except ValueError as err:
      reasons.append(f"{family.name}: {err}")
  if not held:
    raise ValueError(f"no Hugging Face family kvjax writes holds this model; {'; '.join(reasons)}")
  return next((e for e in held if e.config == config), held[0])


def hf_tensors(params: dict, export: Export) -> dict[str, np.ndarray]:
  """kvjax params -> {safetensors name: float32 array} in the family's layout. A parameter the
  written config has and `params` lack (an added bias) is zeros."""
  shapes = flatten(abstract_params(export.config))
  given = flatten(params)
  by_name = collections.defaultdict(list)
  for t in export.plan:
    value = given.get(t.path)
    value = np.zeros(shapes[t.path].shape, np.float32) if value is None else np.asarray(value, np.float32)
    if value.shape != shapes[t.path].shape:
      raise ValueError(
        f"params {'/'.join(t.path)} has shape {value.shape}, not {shapes[t.path].shape} as the model config implies"
      )
    by_name[t.hf].append((t, value))
  return {export.family.hf_name(name): np.ascontiguousarray(write(parts)) for name, parts in by_name.items()}


def export_hf(
  params, config: ModelConfig, out_dir: str | pathlib.Path, *, tokenizer: pathlib.Path | None = None
) -> dict:
  """Writes config.json and model.safetensors (and a copy of `tokenizer`, a tokenizer.json) into
  out_dir, which must not exist or be empty. Returns {"family", "files"}."""
  out = pathlib.Path(out_dir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"export directory {out} must not exist or be empty: nothing is written over files")
  export = plan_export(config, params)
  tensors = hf_tensors(params, export)  # every check before a byte is written
  tokenizer_bytes = None if tokenizer is None else pathlib.Path(tokenizer).read_bytes()
  out.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(export.hf, indent=2) + "\n")
  files = ["config.json", WEIGHTS_FILE]
  if tokenizer_bytes is not None:
    (out / TOKENIZER_FILE).write_bytes(tokenizer_bytes)
    files.append(TOKENIZER_FILE)
  return {"family": export.family.name, "files": files}
