"""`kvjax kv-size MODEL`: KV-cache bytes per token for a model and its MHA / GQA / MQA (and MLA)
variants, as the cache kinds count them, and the batch or context that fits a device
(kvjax.interop.kv_size)."""

from __future__ import annotations

import argparse
import json

from kvjax.cli import options
from kvjax.cache.config import LAYOUTS, CacheConfig
from kvjax.interop.architectures import PRESETS, resolve
from kvjax.interop.kv_size import BYTES_PER_ELEMENT, DTYPE_NAMES, parse_bytes, plan, render


def _mla(text: str) -> tuple[int, int]:
  rank, sep, rope_dims = text.partition(":")
  try:
    return int(rank), int(rope_dims or 0)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected RANK:ROPE_DIMS such as 512:64, got {text!r}") from None


def command(args: argparse.Namespace) -> int:
  memory = None if args.device_memory is None else parse_bytes(args.device_memory)
  result = plan(
    resolve(args.model),
    context=args.context,
    batch=args.batch,
    dtype=args.dtype,
    weight_dtype=args.weight_dtype,
    device_memory=memory,
    devices=args.devices,
    mla=tuple(args.mla),
    layout=args.layout,
    page_size=args.page_size,
  )
  print(json.dumps(result) if args.json else render(result))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("kv-size", help="KV-cache bytes per token and what fits a device")
  parser.add_argument("model", help=f"preset ({', '.join(PRESETS)}), config file, kvjax workdir or HF directory")
  parser.add_argument("--context", type=options.positive_int, default=4096, help="tokens per sequence (default 4096)")
  parser.add_argument("--batch", type=options.positive_int, default=1, help="sequences (default 1)")
  parser.add_argument("--dtype", default="bf16", help=f"cache format {DTYPE_NAMES} (quantized ones count their scales)")
  parser.add_argument(
    "--layout", default="contiguous", help=f"cache layout {LAYOUTS} (default contiguous: windowed layers keep rings)"
  )
  parser.add_argument(
    "--page-size",
    type=options.positive_int,
    default=CacheConfig.page_size,
    help=f"tokens per page of a paged cache (default {CacheConfig.page_size})",
  )
  parser.add_argument(
    "--weight-dtype",
    type=options.nonempty_text,
    help=f"weight element type {tuple(BYTES_PER_ELEMENT)} (default: --dtype, or bf16 for int4 caches)",
  )
  parser.add_argument("--device-memory", help="e.g. 80GB (10^9 bytes) or 80GiB (2^30)")
  parser.add_argument(
    "--devices",
    type=options.positive_int,
    default=1,
    help="devices the model is split across, tensor parallel (default 1)",
  )
  parser.add_argument(
    "--mla",
    type=_mla,
    action="append",
    default=[],
    metavar="RANK:ROPE_DIMS",
    help="add a multi-head latent attention variant (latent rank, rotary dims); repeatable",
  )
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.set_defaults(func=command)
