"""`kvjax eval --workdir DIR`: held-out loss per token, perplexity, bits per byte and accuracy of
a checkpoint (kvjax.training.evaluate.evaluate_checkpoint); --corpus and --seq-len choose the text
and the window length in tokens (an imported model: English prose by default).

`kvjax eval --workdir DIR --recall 512,1024`: instead, the long-range recall test, printed as one
JSON object: for a model with a tokenizer (an imported model), a pass key hidden at a random
depth of English prose in prompts of that many tokens and asked for (kvjax.studies.suite.passkey; the
samples and the answers written to DIR/samples.jsonl and DIR/answers.jsonl); for a byte-level
model trained here, greedy copies of needles planted that many bytes back (kvjax.studies.suite.recall).
Both decode through the KV cache (--set cache.dtype=int8 cache.layout=paged ...).

`kvjax eval --workdir DIR --ruler 1024,2048 [--tasks niah_single_1,vt] [--samples N]`: instead,
the RULER-style suite (kvjax.studies.ruler) on an imported model through the cache --set gives,
its summary printed as one JSON object, its samples.jsonl and answers.jsonl written to --out
(default DIR/ruler)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvjax.cli import options
from kvjax.interop.hf_files import TOKENIZER_FILE
from kvjax.studies.suite.passkey import PasskeyConfig
from kvjax.studies.suite.passkey_run import passkey_checkpoint
from kvjax.studies.suite.recall import RecallConfig, recall_checkpoint
from kvjax.studies.ruler import ruler_checkpoint
from kvjax.studies.suite.ruler_tasks import TASKS, check_tasks
from kvjax.training.evaluate import evaluate_checkpoint


def distances(text: str) -> tuple[int, ...]:
  """The argparse type of --recall: comma-separated positive integers (prompt lengths in tokens,
  or distances in bytes for a byte-level model)."""
  try:
    values = tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be comma-separated distances, e.g. 256,512, got {text!r}") from None
  if any(v < 1 for v in values):
    raise argparse.ArgumentTypeError(f"distances must be positive, got {text!r}")
  return values


def task_names(text: str) -> tuple[str, ...]:
  """The argparse type of --tasks: comma-separated RULER task names."""
  try:
    return check_tasks(part.strip() for part in text.split(","))
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None


def ruler(args: argparse.Namespace) -> int:
  if args.recall is not None or args.mesh is not None or args.split != "val" or args.batches or args.batch_size:
    raise ValueError("--ruler runs the suite alone: --recall, --mesh, --split, --batches and --batch-size do not apply")
  result = ruler_checkpoint(
    args.workdir,
    args.ruler,
    tasks=args.tasks or tuple(TASKS),
    samples=args.samples,
    seed=args.seed,
    cache_config=options.cache_config(args),
    out=args.out,
    progress=lambda message: print(message, file=sys.stderr, flush=True),
  )
  print(json.dumps(result))
  return 0


def command(args: argparse.Namespace) -> int:
  if args.ruler is not None:
    return ruler(args)
  if args.tasks is not None or args.out is not None:
    raise ValueError("--tasks and --out apply to the RULER-style suite (--ruler)")
  if args.recall is not None:
    if args.mesh is not None or args.split != "val" or args.batches or args.batch_size:
      raise ValueError("--recall runs the recall test alone: --mesh, --split, --batches and --batch-size do not apply")
    if (pathlib.Path(args.workdir) / TOKENIZER_FILE).exists():
      if args.needle_bytes is not None:
        raise ValueError(
          "--needle-bytes applies to byte-level models; a tokenized model's needle is a "
          f"{PasskeyConfig.digits}-digit pass key"
        )
      config = PasskeyConfig(lengths=args.recall, needles=args.needles or PasskeyConfig.needles, seed=args.seed)
      result = passkey_checkpoint(
        args.workdir,
        config,
        step=args.step,
        cache_config=options.cache_config(args),
        weights=options.decode_set(args).weights,
      )
    else:
      if args.overrides:
        raise ValueError(
          "the byte-level recall test decodes through a float contiguous cache: "
          "--set cache.* applies to tokenized models"
        )
      config = RecallConfig(
        distances=args.recall,
        needles=args.needles or RecallConfig.needles,
        seed=args.seed,
        needle_bytes=args.needle_bytes or RecallConfig.needle_bytes,
      )
      result = recall_checkpoint(args.workdir, config, step=args.step)
    print(json.dumps(result))
    return 0
  result = evaluate_checkpoint(
    args.workdir,
    step=args.step,
    split=args.split,
    batch_size=args.batch_size,
    num_batches=args.batches,
    mesh=options.mesh(args),
    cache_config=options.cache_config(args),
    weights=options.decode_set(args).weights,
    corpus=args.corpus,
    seq_len=args.seq_len,
  )
  trained_on = result["trained_corpus_sha256"]
  if trained_on and trained_on != result["corpus_sha256"]:
    print(
      f"kvjax eval: warning: corpus {result['corpus']} differs from the one this model was trained "
      f"on (sha256 {result['corpus_sha256'][:12]} vs {trained_on[:12]})",
      file=sys.stderr,
    )
  if args.json:
    print(json.dumps(result))
  else:
    cache = result["cache"]
    through = f" through a {cache['layout']} {cache['dtype'] or 'float'} cache" if cache else ""
    print(
      f"step {result['step']}  {result['split']}{through} loss/token {result['loss']:.4f}  "
      f"perplexity {result['perplexity']:.3f}  bits/byte {result['bits_per_byte']:.4f}  "
      f"accuracy {result['accuracy']:.4f}  ({result['tokens']} tokens in windows of {result['seq_len']})"
    )
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("eval", help="evaluate a checkpoint on the held-out split")
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="run directory holding checkpoints/")
  parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  parser.add_argument("--split", default="val", choices=("val", "train"))
  parser.add_argument(
    "--batches", type=options.positive_int, help="number of batches (default: the run's train.eval_batches)"
  )
  parser.add_argument(
    "--batch-size", type=options.positive_int, help="windows per batch (default: the run's train.batch_size)"
  )
  parser.add_argument(
    "--corpus",
    type=options.path_text,
    help="text to score: 'prose' (Python's documentation), 'stdlib' (Python's sources) or a "
    "path (default: the run's corpus; prose for an imported model)",
  )
  parser.add_argument(
    "--seq-len", type=options.positive_int, help="tokens per window, up to the model's context (default: the run's)"
  )
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  options.add_cache_set_option(parser)  # scores a prefill through that cache instead of the plain forward
  options.add_mesh_option(parser)
  recall = parser.add_argument_group("long-range recall (kvjax.studies.suite.recall)")
  recall.add_argument(
    "--recall",
    type=distances,
    metavar="D1,D2,...",
    help="run the recall test instead, and print JSON: pass-key prompts of these lengths in tokens "
    "(samples.jsonl and answers.jsonl written to the workdir); needle distances in bytes for a byte-level model",
  )
  recall.add_argument("--needles", type=options.positive_int, help="needles per length (distance)")
  recall.add_argument(
    "--needle-bytes",
    type=options.positive_int,
    help=f"byte-level models: bytes per needle (default {RecallConfig.needle_bytes})",
  )
  recall.add_argument("--seed", type=options.seed, default=RecallConfig.seed, help="seed of needles and filler")
  suite = parser.add_argument_group("RULER-style suite (kvjax.studies.ruler)")
  suite.add_argument(
    "--ruler", type=distances, metavar="L1,L2,...", help="run the suite at these prompt lengths (tokens) instead"
  )
  suite.add_argument("--tasks", type=task_names, help=f"comma-separated tasks (default all: {','.join(TASKS)})")
  suite.add_argument("--samples", type=options.positive_int, default=8, help="samples per task and length")
  suite.add_argument(
    "--out", type=options.path_text, help="folder for samples.jsonl, answers.jsonl (default DIR/ruler)"
  )
  parser.set_defaults(func=command)
