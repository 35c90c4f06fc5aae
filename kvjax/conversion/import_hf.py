"""A Hugging Face model directory -> a kvjax workdir: kvjax.interop.hf reads the weights,
kvjax.training.checkpoint writes them as a params checkpoint that eval, generate and uptrain load.
"""

from __future__ import annotations

import pathlib

import jax

from kvjax.interop.hf import copy_tokenizer, from_hf
from kvjax.training import checkpoint


def import_hf(hf_dir: str | pathlib.Path, workdir: str | pathlib.Path, *, dtype: str | None = None) -> dict:
  """from_hf, then save_params into workdir (which must hold no checkpoint), with the model's
  tokenizer.json (checked by from_hf) copied beside it when it has one; returns a summary."""
  if checkpoint.latest_step(workdir) is not None:
    raise ValueError(f"{checkpoint.checkpoint_dir(workdir)} already holds checkpoints; "
                     "import into a new --workdir")
  params, cfg = from_hf(hf_dir, dtype=dtype)  # checks tokenizer.json too
  # The tokenizer first: a workdir whose checkpoint exists always has it, even if this is killed.
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  tokenizer = copy_tokenizer(hf_dir, workdir)
  path = checkpoint.save_params(workdir, params, cfg)
  return {"source": str(pathlib.Path(hf_dir).resolve()), "checkpoint": str(path),
          "params": int(sum(x.size for x in jax.tree.leaves(params))), "model": cfg.to_dict(),
          "tokenizer": None if tokenizer is None else str(tokenizer)}
