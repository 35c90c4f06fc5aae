"""`kvjax uptrain --from SRC --workdir DEST --kv-heads K [--method M]` (or `--to-mla RANK
--rope-dims D`): the conversion these flags name (kvjax.conversion.conversions: KVHeads or ToMLA),
then continued training or layer-local recovery (`--recovery local`; kvjax.conversion.uptrain); prints quality before, at and after.
`--init RECOVERED_WORKDIR` starts the continued training (with `--distill W`: distillation from the
source) from a finished layer-local recovery of the same source by the same conversion."""

from __future__ import annotations

import argparse

from kvjax.cli import options
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.conversion.kv_heads import METHODS
from kvjax.conversion.uptrain import RECOVERIES, uptrain


def conversion(args: argparse.Namespace) -> KVHeads | ToMLA:
  """The one conversion the flags name, or a ValueError saying which flags go together."""
  if (args.kv_heads is None) == (args.to_mla is None):
    raise ValueError("give exactly one of --kv-heads K (GQA / MQA) and --to-mla RANK (MLA)")
  if args.to_mla is None:
    if args.rope_dims is not None:
      raise ValueError("--rope-dims D goes with --to-mla RANK, not --kv-heads")
    return KVHeads(args.kv_heads, args.method, args.seed)
  if args.rope_dims is None:
    raise ValueError("--to-mla RANK and --rope-dims D go together")
  if args.method != "mean" or args.seed:
    raise ValueError("--method and --seed choose how kv heads are regrouped (--kv-heads), not --to-mla")
  return ToMLA(args.to_mla, args.rope_dims)


def command(args: argparse.Namespace) -> int:
  overrides = args.overrides + ([f"train.mesh={args.mesh}"] if args.mesh is not None else [])
  record = uptrain(
    args.source,
    args.workdir,
    conversion(args),
    fraction=args.fraction,
    distill=args.distill,
    recovery=args.recovery,
    init=args.init,
    overrides=overrides,
  )
  rows = [
    ("before conversion", record["before"]),
    ("converted (alpha=0)", record["converted"]),
    *([(f"init ({record['init']['recovery']})", record["recovered"])] if "recovered" in record else []),
    (
      f"{'recovered' if record.get('recovery') == 'local' else 'uptrained'} (alpha={record['fraction']})",
      record["after"],
    ),
  ]
  for name, q in rows:
    print(f"{name:>22}: loss {q['loss']:.4f}  bits/byte {q['bits_per_byte']:.4f}  accuracy {q['accuracy']:.4f}")
  for point in record.get("curve", []):
    closed = "" if point["gap_closed"] is None else f"  gap closed {point['gap_closed']:.1%}"
    print(f"{'step ' + str(point['step']):>22}: val loss {point['val_loss']:.4f}{closed}")
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("uptrain", help="convert an MHA checkpoint to GQA/MQA or MLA and continue training")
  parser.add_argument(
    "--from",
    dest="source",
    required=True,
    metavar="SRC_WORKDIR",
    type=options.workdir_text,
    help="training (or imported) workdir to convert; never modified",
  )
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="where the uptrained run is written")
  parser.add_argument("--kv-heads", type=options.positive_int, help="target number of kv heads (GQA / MQA)")
  parser.add_argument(
    "--method",
    choices=METHODS,
    default="mean",
    help="with --kv-heads: mean (the paper's), first, random, or the data-aware pca / regroup",
  )
  parser.add_argument("--seed", type=options.seed, default=0, help="rng seed for --method random")
  parser.add_argument(
    "--to-mla",
    type=options.positive_int,
    metavar="RANK",
    help="convert to multi-head latent attention with this latent rank (needs --rope-dims)",
  )
  parser.add_argument(
    "--rope-dims",
    type=options.nonnegative_int,
    metavar="D",
    help="with --to-mla: rotary dims of the shared key, 2 x kept pairs x kv heads (0 for learned positions)",
  )
  parser.add_argument(
    "--fraction",
    type=float,
    default=0.05,
    help="uptraining steps as a fraction of the source's pre-training steps (alpha)",
  )
  parser.add_argument(
    "--distill",
    type=float,
    default=0.0,
    metavar="W",
    help="add W x KL to the source model's next-token distribution to the loss (distillation)",
  )
  parser.add_argument(
    "--recovery",
    choices=RECOVERIES,
    default="train",
    help="train: continue training the whole network (end to end, with --distill); local: each converted "
    "layer's attention learns the source layer's output, train.steps steps per layer (fits a CPU)",
  )
  parser.add_argument(
    "--init",
    metavar="RECOVERED_WORKDIR",
    type=options.workdir_text,
    help="with --recovery train: start from the params of this finished uptraining of the same source by the same "
    "conversion (a --recovery local run) instead of the converted ones; the teacher stays the source",
  )
  options.add_set_option(parser)
  options.add_mesh_option(parser)
  parser.set_defaults(func=command)
