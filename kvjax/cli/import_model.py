"""`kvjax import-hf HF_DIR --workdir OUT`: a Hugging Face safetensors model as a kvjax checkpoint
(kvjax.conversion.import_hf); prints the summary as JSON."""

from __future__ import annotations

import argparse
import json

from kvjax.cli import options
from kvjax.conversion.import_hf import import_hf
from kvjax.interop.hf import DTYPES


def command(args: argparse.Namespace) -> int:
  print(json.dumps(import_hf(args.hf_dir, args.workdir, dtype=args.dtype)))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
      "import-hf", help="convert a Hugging Face Llama / Qwen2 / GPT-2 safetensors model to a kvjax checkpoint")
  parser.add_argument("hf_dir", help="folder with config.json and *.safetensors")
  parser.add_argument("--workdir", required=True, type=options.workdir_text,
                      help="new kvjax workdir to write the checkpoint into")
  parser.add_argument("--dtype", choices=tuple(DTYPES), help="compute dtype (default: the checkpoint's)")
  parser.set_defaults(func=command)
