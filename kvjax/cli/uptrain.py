"""`kvjax uptrain --from SRC --workdir DEST --kv-heads K`: convert an MHA checkpoint to GQA / MQA
and continue training it (kvjax.conversion.uptrain); prints quality before, at and after."""

from __future__ import annotations

import argparse

from kvjax.cli import options
from kvjax.conversion.kv_heads import METHODS
from kvjax.conversion.uptrain import uptrain


def command(args: argparse.Namespace) -> int:
  overrides = args.overrides + ([f"train.mesh={args.mesh}"] if args.mesh is not None else [])
  record = uptrain(args.source, args.workdir, args.kv_heads, method=args.method, fraction=args.fraction,
                   distill=args.distill, overrides=overrides, seed=args.seed)
  rows = [("before conversion", record["before"]), ("converted (alpha=0)", record["converted"]),
          (f"uptrained (alpha={record['fraction']})", record["after"])]
  for name, q in rows:
    print(f"{name:>22}: loss {q['loss']:.4f}  bits/byte {q['bits_per_byte']:.4f}  accuracy {q['accuracy']:.4f}")
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("uptrain", help="convert an MHA checkpoint to GQA/MQA and continue training")
  parser.add_argument("--from", dest="source", required=True, metavar="SRC_WORKDIR",
                      help="training (or imported) workdir to convert; never modified")
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="where the uptrained run is written")
  parser.add_argument("--kv-heads", type=int, required=True, help="target number of kv heads")
  parser.add_argument("--method", choices=METHODS, default="mean",
                      help="mean (the paper's), first, random, or the data-aware pca / regroup")
  parser.add_argument("--fraction", type=float, default=0.05,
                      help="uptraining steps as a fraction of the source's pre-training steps (alpha)")
  parser.add_argument("--distill", type=float, default=0.0, metavar="W",
                      help="add W x KL to the source model's next-token distribution to the loss (distillation)")
  parser.add_argument("--seed", type=int, default=0, help="rng seed for --method random")
  options.add_set_option(parser)
  options.add_mesh_option(parser)
  parser.set_defaults(func=command)
