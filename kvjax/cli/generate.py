"""`kvjax generate`: continue a prompt with a checkpointed model, streaming the text to the
terminal as tokens are produced (kvjax.decoding.stream).

A workdir with a tokenizer (an imported model: tokenizer.json and tokenizer_config.json) encodes
the prompt with it, stops at its end tokens (eos and the chat end-of-turn token) and, with
--chat, wraps the prompt as a user message in the model's chat template. A model trained here
reads UTF-8 bytes: a cut multi-byte sequence shows as U+FFFD, and no token stops it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

import jax

from kvjax.cache.config import CacheConfig
from kvjax.cli import options
from kvjax.model.weights import store
from kvjax.decoding.sampling import Sampling
from kvjax.decoding.stream import TextStream, stream
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.training import data
from kvjax.training.checkpoint import load_model


def prompt_tokens(tokenizer: TextTokenizer | None, prompt: str, *, chat: bool = False, system: str | None = None):
  """The prompt's ids: bytes without a tokenizer; with one, the plain text (bos first when the
  tokenizer adds one) or, with chat, the chat template's rendering of [system,] user messages."""
  if tokenizer is None:
    if chat or system is not None:
      raise ValueError(
        "--chat and --system need a model with a tokenizer and a chat template "
        "(an imported model); this one reads bytes"
      )
    tokens = data.encode(prompt)
  elif not chat:
    if system is not None:
      raise ValueError("--system applies to --chat only")
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
  else:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
      {"role": "user", "content": prompt}
    ]
    tokens = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
  if not len(tokens):
    raise ValueError(f"--prompt {prompt!r} gives this model no tokens: there is nothing to continue")
  return tokens


def continue_text(
  workdir,
  prompt: str,
  *,
  max_new_tokens: int,
  sampling: Sampling = Sampling(),
  seed: int = 0,
  step: int | None = None,
  mesh=None,
  cache_config: CacheConfig | None = None,
  weights: str = "float32",
  chat: bool = False,
  system: str | None = None,
  on_text: Callable[[str], None] | None = None,
) -> str:
  """The continuation of `prompt` from the workdir's checkpoint (latest unless `step`), up to its
  tokenizer's first stop token (not included), sharded over `mesh` when one is given, decoding
  through a KV cache of `cache_config` (default: contiguous, the model's dtype), with the weights
  stored as `weights` (kvjax.model.weights). on_text(increment) is called as the text grows (a
  terminal prints it)."""
  model, params, _ = load_model(workdir, step)
  params = store(params, weights)
  tokenizer = TextTokenizer.load(workdir, model.config.vocab_size)
  tokens = prompt_tokens(tokenizer, prompt, chat=chat, system=system)
  stop_ids = () if tokenizer is None else tokenizer.stop_ids
  text = TextStream(data.decode if tokenizer is None else tokenizer.decode)
  pieces = []
  for token in stream(
    model,
    params,
    tokens,
    max_new_tokens,
    sampling=sampling,
    stop_ids=stop_ids,
    rng=jax.random.key(seed),
    mesh=mesh,
    cache_config=(cache_config or CacheConfig()).bind(tokenizer),
  ):
    if token in stop_ids:
      break
    pieces.append(text.push(token))
    if on_text is not None and pieces[-1]:
      on_text(pieces[-1])
  pieces.append(text.flush())
  if on_text is not None and pieces[-1]:
    on_text(pieces[-1])
  return "".join(pieces)


def text_argument(text: str) -> str:
  """The argparse type of --prompt and --system: text that UTF-8 can encode (a command line in
  another encoding arrives with undecodable bytes as lone surrogates)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:
    raise argparse.ArgumentTypeError(
      f"is not UTF-8 text: {err.object[err.start : err.end]!r} at character {err.start} cannot be encoded"
    ) from None
  return text


def temperature(text: str) -> float:
  """The argparse type of --temperature: a finite number >= 0."""
  value = _float(text)
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 is greedy), got {text}")
  return value


def top_p(text: str) -> float:
  """The argparse type of --top-p: a probability mass in (0, 1]."""
  value = _float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
  return value


def _float(text: str) -> float:
  try:
    return float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _print(text: str) -> None:
  sys.stdout.write(text)
  sys.stdout.flush()


def command(args: argparse.Namespace) -> int:
  continue_text(
    args.workdir,
    args.prompt,
    max_new_tokens=args.max_new_tokens,
    sampling=Sampling.create(args.temperature, args.top_k, args.top_p),
    seed=args.seed,
    step=args.step,
    mesh=options.mesh(args),
    cache_config=options.cache_config(args),
    weights=options.decode_set(args).weights,
    chat=args.chat,
    system=args.system,
    on_text=_print,
  )
  _print("\n")
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
    "generate", help="continue a prompt (or answer a chat message) with a checkpoint, streaming the text"
  )
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="run directory holding checkpoints/")
  parser.add_argument(
    "--prompt", required=True, type=text_argument, help="text to continue, or with --chat the user's message"
  )
  parser.add_argument(
    "--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template"
  )
  parser.add_argument("--system", type=text_argument, help="with --chat: a system message before the user's")
  parser.add_argument(
    "--max-new-tokens",
    type=options.positive_int,
    default=200,
    help="most tokens to generate (generation also ends at the tokenizer's end tokens)",
  )
  parser.add_argument("--temperature", type=temperature, default=0.8, help="0 is greedy")
  parser.add_argument("--top-k", type=options.positive_int, help="sample among the k most likely tokens")
  parser.add_argument("--top-p", type=top_p, help="sample within the top-p probability mass")
  parser.add_argument("--seed", type=options.seed, default=0, help="sampling seed")
  parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  options.add_cache_set_option(parser)
  options.add_mesh_option(parser)
  parser.set_defaults(func=command)
