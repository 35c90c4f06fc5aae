"""`kvjax import SOURCE --workdir OUT`: a pretrained model as a kvjax checkpoint
(kvjax.conversion.import_model); prints the summary as JSON. SOURCE is a named model
(`smollm2-135m`), a GGUF file or a Hugging Face safetensors directory; `import-hf` is the same
command under its older name."""

from __future__ import annotations

import argparse
import json

from kvjax.cli import options
from kvjax.conversion.import_model import import_model
from kvjax.interop.family import DTYPES
from kvjax.interop.importer import NAMED_MODELS


def command(args: argparse.Namespace) -> int:
  print(json.dumps(import_model(args.source, args.workdir, dtype=args.dtype)))
  return 0


def add_parser(subparsers) -> None:
  names = ", ".join(f"{name} ({model.description}; {model.install})" for name, model in NAMED_MODELS.items())
  description = f"Named models: {names}. Families: Llama (Llama 2/3, SmolLM, Mistral-style), Qwen2, GPT-2 (safetensors only), Gemma 3 (GGUF only)."
  # One parser per name, not an alias, so that its errors name the command as it was typed.
  summaries = {
    "import": "convert a pretrained model (named, GGUF, or Hugging Face safetensors) to a kvjax checkpoint",
    "import-hf": "the same as import (its older name)",
  }
  for name, summary in summaries.items():
    parser = subparsers.add_parser(name, help=summary, description=description)
    parser.add_argument(
      "source",
      type=options.path_text,
      help="a named model, a .gguf file, or a folder with config.json and *.safetensors",
    )
    parser.add_argument(
      "--workdir", required=True, type=options.workdir_text, help="new kvjax workdir to write the checkpoint into"
    )
    parser.add_argument(
      "--dtype", choices=tuple(DTYPES), help="compute dtype (default: a safetensors checkpoint's, float32 for GGUF)"
    )
    parser.set_defaults(func=command)
