"""Held-out evaluation: next-byte loss, bits per byte and accuracy; the `kvjax eval` subcommand.

With the byte tokenizer one token is one byte, so bits per byte = loss (nats per token) / ln 2.
A model that predicts the uniform distribution scores exactly 8 bits per byte. A workdir with a
tokenizer.json (an imported model) is evaluated on the same text in that tokenizer's ids.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from kvjax import sharding
from kvjax.training.checkpoint import latest_step, load_model, read_meta
from kvjax.config import from_dict
from kvjax.training.data import Dataset, eval_batches, load_dataset, retokenize
from kvjax.interop.hf import load_tokenizer
from kvjax.model.transformer import Transformer
from kvjax.training.config import DataConfig


@functools.partial(jax.jit, static_argnames="model")
def _eval_sums(model: Transformer, params, inputs, targets):
  """inputs, targets int32 [B, T] -> (summed loss, number of correct argmax predictions)."""
  logits = model.apply({"params": params}, inputs)  # [B, T, V]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()
  return loss, (logits.argmax(-1) == targets).sum()


def evaluate(model: Transformer, params, data: Dataset, *, batch_size: int, num_batches: int,
             split: str = "val", mesh: Mesh | None = None) -> dict:
  """Mean next-token loss (nats), bits per byte and accuracy over fixed windows of a split,
  sharded over `mesh` (kvjax.sharding's rules; batch_size must split over `data`) when given.
  Bits per byte is loss / ln 2 / data.bytes_per_token (exact for bytes, a corpus average otherwise)."""
  if split not in ("val", "train"):
    raise ValueError(f"split must be 'val' or 'train', got {split!r}")
  tokens = data.val if split == "val" else data.train
  batches = eval_batches(tokens, data.seq_len, batch_size, num_batches)
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
    batches = (sharding.shard_batch(mesh, x, y) for x, y in batches)
  sums = [_eval_sums(model, params, x, y) for x, y in batches]
  count = batch_size * num_batches * data.seq_len
  loss = float(np.sum([np.float64(s[0]) for s in sums])) / count
  correct = int(np.sum([int(s[1]) for s in sums]))
  return {"loss": loss, "bits_per_byte": loss / math.log(2) / data.bytes_per_token, "accuracy": correct / count}


def command(args: argparse.Namespace) -> int:
  step = latest_step(args.workdir) if args.step is None else args.step
  mesh = sharding.mesh_from_arg(args.mesh)
  model, params, config = load_model(args.workdir, step, mesh=mesh)
  meta = read_meta(args.workdir, step)
  data_config = from_dict(DataConfig, config["data"]) if "data" in config else DataConfig(
      seq_len=min(128, model.config.max_len))
  train = config.get("train", {})
  batch_size = args.batch_size or train.get("batch_size", 8)
  num_batches = args.batches or train.get("eval_batches", 8)
  data = load_dataset(data_config)
  tokenizer = load_tokenizer(args.workdir)
  saved_hash = meta.get("corpus", {}).get("sha256")
  if saved_hash and saved_hash != data.info.sha256:
    print(f"kvjax eval: warning: corpus {data.info.source} differs from the one this model was trained "
          f"on (sha256 {data.info.sha256[:12]} vs {saved_hash[:12]})", file=sys.stderr)
  if tokenizer is not None:
    data = retokenize(data, lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
  metrics = evaluate(model, params, data, batch_size=batch_size, num_batches=num_batches, split=args.split,
                     mesh=mesh)
  result = {"step": step, "split": args.split, **metrics,
            "tokens": batch_size * num_batches * data_config.seq_len, "corpus_sha256": data.info.sha256}
  if args.json:
    print(json.dumps(result))
  else:
    print(f"step {step}  {args.split} loss {metrics['loss']:.4f}  bits/byte {metrics['bits_per_byte']:.4f}  "
          f"accuracy {metrics['accuracy']:.4f}  ({result['tokens']} tokens)")
  return 0


def positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("eval", help="evaluate a checkpoint on the held-out split")
  parser.add_argument("--workdir", required=True, help="run directory holding checkpoints/")
  parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  parser.add_argument("--split", default="val", choices=("val", "train"))
  parser.add_argument("--batches", type=positive_int, help="number of batches (default: the run's train.eval_batches)")
  parser.add_argument("--batch-size", type=positive_int, help="windows per batch (default: the run's train.batch_size)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  sharding.add_mesh_argument(parser)
  parser.set_defaults(func=command)
