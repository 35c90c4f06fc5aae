"""`kvjax export-hf --workdir W --out DIR`: a kvjax checkpoint as a Hugging Face model directory
of the family that holds it, Llama, Qwen2 or GPT-2 (kvjax.interop.hf_export), with the workdir's
tokenizer.json when it has one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvjax.cli import options
from kvjax.interop.hf_export import export_hf
from kvjax.interop.hf_files import TOKENIZER_FILE
from kvjax.training.checkpoint import load_model


def command(args: argparse.Namespace) -> int:
  model, params, _ = load_model(args.workdir, args.step)
  tokenizer = Path(args.workdir) / TOKENIZER_FILE
  result = export_hf(params, model.config, args.out, tokenizer=tokenizer if tokenizer.is_file() else None)
  print(json.dumps({"out": str(args.out), **result}))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("export-hf", help="write a checkpoint as a Hugging Face Llama, Qwen2 or GPT-2 model")
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="kvjax workdir holding checkpoints/")
  parser.add_argument(
    "--out",
    required=True,
    type=options.workdir_text,
    help="new (or empty) folder for config.json and model.safetensors",
  )
  parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  parser.set_defaults(func=command)
