"""`kvjax generate`: continue a text prompt with a checkpointed model, decoding with the KV cache.

The prompt is encoded as UTF-8 bytes, and the continuation's bytes decoded with invalid or cut
multi-byte sequences shown as U+FFFD; a workdir with a tokenizer.json (an imported model) uses
that tokenizer instead.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from kvjax.cli import options
from kvjax.training import data
from kvjax.training.checkpoint import load_model
from kvjax.interop.hf import load_tokenizer
from kvjax.decoding.decode import generate


def continue_text(workdir, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  step: int | None = None, mesh=None, cache_dtype: str | None = None) -> str:
  """The continuation of `prompt` from the workdir's checkpoint (latest unless `step`), sharded
  over `mesh` (a jax.sharding.Mesh, see kvjax.sharding) when one is given, decoding with a KV
  cache of `cache_dtype` (default: the checkpoint's)."""
  model, params, _ = load_model(workdir, step)
  if cache_dtype is not None:
    model = model.clone(config=model.config.replace(cache_dtype=cache_dtype))
  tokenizer = load_tokenizer(workdir, model.config.vocab_size)
  if tokenizer is None:
    tokens = data.encode(prompt)
  else:
    tokens = np.asarray(tokenizer.encode(prompt).ids, np.int32)
  out = generate(model, params, tokens[None, :], [len(tokens)], max_new_tokens, temperature=temperature,
                 top_k=top_k, top_p=top_p, rng=jax.random.key(seed), mesh=mesh)
  ids = np.asarray(out[0])
  return data.decode(ids) if tokenizer is None else tokenizer.decode(ids.tolist())


def command(args: argparse.Namespace) -> int:
  print(continue_text(args.workdir, args.prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, step=args.step, mesh=options.mesh(args),
                      cache_dtype=options.cache_dtype(args)))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("generate", help="continue a prompt with a trained checkpoint")
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="run directory holding checkpoints/")
  parser.add_argument("--prompt", required=True, help="text to continue")
  parser.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate")
  parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
  parser.add_argument("--top-k", type=int, help="sample among the k most likely bytes")
  parser.add_argument("--top-p", type=float, help="sample within the top-p probability mass")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed")
  parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                      help="model.cache_dtype=FORMAT: the KV cache's format (int8, int4, float8_e4m3fn, ...)")
  options.add_mesh_option(parser)
  parser.set_defaults(func=command)
