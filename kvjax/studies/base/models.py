"""The models a study reads, in one place: a workdir's checkpoint with the tokenizer saved beside
it, or any source `kvjax import` takes (a name, a .gguf file, a Hugging Face folder)."""

from __future__ import annotations

from pathlib import Path

from kvjax.interop.importer import read_model
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.training.checkpoint import latest_step, load_model


def tokenized_checkpoint(workdir: str | Path, step: int | None = None, *, needs: str | None = None):
  """(model, params, tokenizer) of a workdir's checkpoint (latest unless `step`). The tokenizer is
  None for a model trained here on bytes, unless `needs` says why the caller cannot do without
  one: then that is a ValueError naming the workdir."""
  model, params, _ = load_model(workdir, step)
  tokenizer = TextTokenizer.load(workdir, model.config.vocab_size)
  if tokenizer is None and needs is not None:
    raise ValueError(f"{workdir} has no tokenizer: {needs}")
  return model, params, tokenizer


def tokenized_model(source: str, *, needs: str):
  """(model, params, tokenizer, a name for reports) of a kvjax workdir with a checkpoint, a named
  model, a file or a directory; ValueError naming the source when it has no tokenizer (`needs`
  says why one is needed)."""
  path = Path(source)
  if path.is_dir() and latest_step(path) is not None:
    return (*tokenized_checkpoint(path, needs=needs), path.name)
  params, config, tokenizer, resolved = read_model(source)
  if tokenizer is None:
    raise ValueError(f"{source!r} has no tokenizer: {needs}")
  return Transformer(config), params, tokenizer, resolved.name
