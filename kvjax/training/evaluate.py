"""Held-out evaluation: next-token loss, perplexity, bits per byte and accuracy (`kvjax eval`).

With the byte tokenizer one token is one byte, so bits per byte = loss (nats per token) / ln 2.
A model that predicts the uniform distribution scores exactly 8 bits per byte. A workdir with a
tokenizer (an imported model) is evaluated in that tokenizer's ids, by default on held-out English
prose (Python's documentation, the "prose" corpus of kvjax.training.data) in windows of a chosen
token length; bits per byte then divides by the held-out text's bytes per token.
Given a `cache_config` (kvjax.cache.config.CacheConfig), the logits are those of a prefill through
an empty cache of that layout, codec and window, which attends to the K/V as the cache stores them
(kvjax.cache.codec): the quality a quantized or windowed cache costs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from kvjax import sharding
from kvjax.training.checkpoint import latest_step, load_model, read_meta
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.fields import from_dict, to_dict
from kvjax.decoding.decode import forward
from kvjax.training.data import PROSE, Dataset, eval_batches, load_dataset
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.model.weights import check_format, store
from kvjax.training.config import DataConfig


@functools.partial(jax.jit, static_argnames=("model", "cache_config"))
def _eval_sums(model: Transformer, params, inputs, targets, cache_config: CacheConfig | None = None):
  """inputs, targets int32 [B, T] -> (summed loss, number of correct argmax predictions); with
  a cache_config, the logits of a prefill into an empty cache of it."""
  if cache_config is not None:
    batch, seq = inputs.shape
    cache = kinds.create(model.config, cache_config, batch, seq)
    logits, _ = forward(model, params, cache, inputs, jnp.full((batch,), seq, jnp.int32), from_empty=True)
  else:
    logits = model.apply({"params": params}, inputs)  # [B, T, V]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()
  return loss, (logits.argmax(-1) == targets).sum()


def evaluate(
  model: Transformer,
  params,
  data: Dataset,
  *,
  batch_size: int,
  num_batches: int,
  split: str = "val",
  mesh: Mesh | None = None,
  cache_config: CacheConfig | None = None,
) -> dict:
  """Mean next-token loss (nats), bits per byte and accuracy over fixed windows of a split,
  sharded over `mesh` (kvjax.sharding's rules; batch_size must split over `data`) when given.
  Bits per byte is loss / ln 2 / data.bytes_per_token (exact for bytes, a corpus average otherwise).
  cache_config: score a prefill through such a cache (module docstring); None, the plain
  forward pass."""
  if split not in ("val", "train"):
    raise ValueError(f"split must be 'val' or 'train', got {split!r}")
  if cache_config is not None and cache_config.press is not None:
    raise ValueError(
      f"CacheConfig.press={cache_config.press!r}: a press compresses a cache after the prompt's own logits, so a "
      "prefill's perplexity is the full cache's; kvjax.studies.eviction scores continuations read through a "
      "pressed cache (configs/eviction)"
    )
  if cache_config is not None:
    cache_config.codec(model.config)  # refuses a codec the model's vectors cannot take, before compiling
    cache_config.model(model.config).check_length(data.seq_len, f"windows of seq_len={data.seq_len} tokens")
  tokens = data.val if split == "val" else data.train
  batches = eval_batches(tokens, data.seq_len, batch_size, num_batches)
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
    batches = (sharding.shard_batch(mesh, x, y) for x, y in batches)
  sums = [_eval_sums(model, params, x, y, cache_config) for x, y in batches]
  count = batch_size * num_batches * data.seq_len
  loss = float(np.sum([np.float64(s[0]) for s in sums])) / count
  correct = int(np.sum([int(s[1]) for s in sums]))
  return {
    "loss": loss,
    "perplexity": math.exp(loss),
    "bits_per_byte": loss / math.log(2) / data.bytes_per_token,
    "accuracy": correct / count,
  }


def evaluate_checkpoint(
  workdir: str | Path,
  *,
  step: int | None = None,
  split: str = "val",
  batch_size: int | None = None,
  num_batches: int | None = None,
  mesh: Mesh | None = None,
  cache_config: CacheConfig | None = None,
  corpus: str | None = None,
  seq_len: int | None = None,
  weights: str = "float32",
) -> dict:
  """`evaluate` of a workdir's checkpoint (latest unless `step`) on the corpus of its run's config.

  batch_size and num_batches default to the run's train.batch_size and train.eval_batches (8
  each for an imported model). A workdir with a tokenizer (an imported model) is evaluated in
  that tokenizer's ids; without a recorded corpus, on "prose" (kvjax.training.data), windows of
  min(128, max_len) tokens. corpus and seq_len (tokens per window, up to the model's context)
  replace the run's.
  Returns the metrics with the step, split, tokens evaluated, the corpus source and sha256, and
  trained_corpus_sha256: the corpus the checkpoint was trained on, when its metadata records one.
  cache_config: as in `evaluate`. weights: the format the weights are evaluated in
  (kvjax.model.weights), recorded in the result.
  """
  check_format(weights)
  if mesh is not None and weights != "float32":
    raise ValueError(f"weights={weights} is for one device; a sharded evaluation (--mesh) runs float32 weights")
  step = latest_step(workdir) if step is None else step
  model, params, config = load_model(workdir, step, mesh=mesh)
  params = store(params, weights)
  meta = read_meta(workdir, step)
  tokenizer = TextTokenizer.load(workdir, model.config.vocab_size)
  if cache_config is not None:
    cache_config = cache_config.bind(tokenizer)
  data_config = (
    from_dict(DataConfig, config["data"])
    if "data" in config
    else DataConfig(source="stdlib" if tokenizer is None else PROSE, seq_len=min(128, model.config.max_len))
  )
  data_config = dataclasses.replace(
    data_config, **({"source": corpus} if corpus else {}), **({"seq_len": seq_len} if seq_len else {})
  )
  model.config.check_length(data_config.seq_len, f"windows of seq_len={data_config.seq_len} tokens")
  train = config.get("train", {})
  batch_size = batch_size or train.get("batch_size", 8)
  num_batches = num_batches or train.get("eval_batches", 8)
  data = load_dataset(data_config, tokenizer)
  metrics = evaluate(
    model,
    params,
    data,
    batch_size=batch_size,
    num_batches=num_batches,
    split=split,
    mesh=mesh,
    cache_config=cache_config,
  )
  cache = None if cache_config is None else to_dict(cache_config)
  return {
    "step": step,
    "split": split,
    "cache": cache,
    "weights": weights,
    **metrics,
    "seq_len": data_config.seq_len,
    "tokens": batch_size * num_batches * data_config.seq_len,
    "corpus": data.info.source,
    "corpus_sha256": data.info.sha256,
    "trained_corpus_sha256": meta.get("corpus", {}).get("sha256"),
  }
