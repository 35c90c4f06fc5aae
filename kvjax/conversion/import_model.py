"""A pretrained model -> a kvjax workdir: kvjax.interop.importer reads a named model, a GGUF file
or a Hugging Face directory; kvjax.training.checkpoint writes it as a params checkpoint that eval,
generate and uptrain load, with the model's tokenizer (tokenizer.json and tokenizer_config.json)
beside it, which every workdir derived from this one carries on.
"""

from __future__ import annotations

import pathlib

import jax

from kvjax.config import ModelConfig
from kvjax.interop.importer import read_model, resolve_source
from kvjax.training import checkpoint
from kvjax.training import workdir as workdirs


def first_layers(params: dict, cfg: ModelConfig, layers: int) -> tuple[dict, ModelConfig]:
  """The model cut to its first `layers` layers (embedding, final norm and head kept): a small
  real model for fast tests. ValueError unless 0 < layers <= cfg.num_layers."""
  if isinstance(layers, bool) or not isinstance(layers, int) or not 0 < layers <= cfg.num_layers:
    raise ValueError(f"layers={layers!r}: the model has {cfg.num_layers} layers; keep 1 to {cfg.num_layers} of them")
  kept = {k: v for k, v in params.items() if not k.startswith("layers_") or int(k.split("_")[1]) < layers}
  return kept, cfg.replace(num_layers=layers)


def import_model(
  source: str | pathlib.Path, workdir: str | pathlib.Path, *, dtype: str | None = None, layers: int | None = None
) -> dict:
  """read_model, then save_params into workdir (which must hold no checkpoint), the tokenizer
  first; returns a summary.

  source: a named model (kvjax.interop.importer.NAMED_MODELS, e.g. "smollm2-135m"), a .gguf file
  or a Hugging Face directory. layers: keep only the first `layers` layers (first_layers). The workdir is claimed as an import's (kvjax.training.workdir): new
  or empty, or an import of the same model (its file and the fingerprint of its config and
  weights) cut short before its checkpoint was written. Its marker records that source. Nothing
  is written when the model, its tokenizer or the workdir is refused."""
  workdirs.check(workdir, workdirs.IMPORT)  # refused before the model is read, with nothing written
  if checkpoint.latest_step(workdir) is not None:
    raise ValueError(f"{checkpoint.checkpoint_dir(workdir)} already holds checkpoints; import into a new --workdir")
  resolved = resolve_source(source).resolve()
  params, cfg, tokenizer, _ = read_model(resolved, dtype=dtype)
  if layers is not None:
    params, cfg = first_layers(params, cfg, layers)
  job = {"source": {"path": str(resolved), "fingerprint": workdirs.fingerprint(cfg.to_dict(), params)}, "dtype": dtype}
  with workdirs.claim(workdir, workdirs.IMPORT, job) as path:
    # The tokenizer first: a workdir whose checkpoint exists always has it, even if this is killed.
    if tokenizer is not None:
      tokenizer.save(path)
    saved = checkpoint.save_params(workdir, params, cfg)
  return {
    "source": str(resolved),
    "checkpoint": str(saved),
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "model": cfg.to_dict(),
    "tokenizer": None if tokenizer is None else str(pathlib.Path(path) / "tokenizer.json"),
  }
