"""A Hugging Face model directory -> a kvjax workdir: kvjax.interop.hf reads the weights,
kvjax.training.checkpoint writes them as a params checkpoint that eval, generate and uptrain load.
"""

from __future__ import annotations

import pathlib
import shutil

import jax

from kvjax.interop.hf import TOKENIZER_FILE, from_hf
from kvjax.training import checkpoint


def import_hf(hf_dir: str | pathlib.Path, workdir: str | pathlib.Path, *, dtype: str | None = None) -> dict:
  """from_hf, then save_params into workdir (which must hold no checkpoint), with tokenizer.json
  copied beside it when the source has one; returns a summary."""
  if checkpoint.latest_step(workdir) is not None:
    raise ValueError(f"{checkpoint.checkpoint_dir(workdir)} already holds checkpoints; "
                     "import into a new --workdir")
  params, cfg = from_hf(hf_dir, dtype=dtype)
  path = checkpoint.save_params(workdir, params, cfg)
  tokenizer = pathlib.Path(hf_dir) / TOKENIZER_FILE
  if tokenizer.is_file():
    tokenizer = pathlib.Path(shutil.copyfile(tokenizer, pathlib.Path(workdir) / TOKENIZER_FILE))
  return {"source": str(pathlib.Path(hf_dir).resolve()), "checkpoint": str(path),
          "params": int(sum(x.size for x in jax.tree.leaves(params))), "model": cfg.to_dict(),
          "tokenizer": str(tokenizer) if tokenizer.is_file() else None}
