"""A Hugging Face model directory -> a kvjax workdir: kvjax.interop.hf reads the weights,
kvjax.training.checkpoint writes them as a params checkpoint that eval, generate and uptrain load.
"""

from __future__ import annotations

import pathlib

import jax

from kvjax.interop.hf import copy_tokenizer, from_hf
from kvjax.training import checkpoint
from kvjax.training import workdir as workdirs


def import_hf(hf_dir: str | pathlib.Path, workdir: str | pathlib.Path, *, dtype: str | None = None) -> dict:
  """from_hf, then save_params into workdir (which must hold no checkpoint), with the model's
  tokenizer.json (checked by from_hf) copied beside it when it has one; returns a summary.

  The workdir is claimed as an import's (kvjax.training.workdir): new or empty, or an import of
  the same model (its folder and the fingerprint of its config and weights) cut short before its
  checkpoint was written. Its marker records that source."""
  source = pathlib.Path(hf_dir).resolve()
  workdirs.check(workdir, workdirs.IMPORT)  # refused before the model is read, with nothing written
  if checkpoint.latest_step(workdir) is not None:
    raise ValueError(f"{checkpoint.checkpoint_dir(workdir)} already holds checkpoints; "
                     "import into a new --workdir")
  params, cfg = from_hf(hf_dir, dtype=dtype)  # checks tokenizer.json too
  job = {"source": {"path": str(source), "fingerprint": workdirs.fingerprint(cfg.to_dict(), params)}, "dtype": dtype}
  with workdirs.claim(workdir, workdirs.IMPORT, job):
    # The tokenizer first: a workdir whose checkpoint exists always has it, even if this is killed.
    tokenizer = copy_tokenizer(hf_dir, workdir)
    path = checkpoint.save_params(workdir, params, cfg)
  return {"source": str(source), "checkpoint": str(path),
          "params": int(sum(x.size for x in jax.tree.leaves(params))), "model": cfg.to_dict(),
          "tokenizer": None if tokenizer is None else str(tokenizer)}
