"""`kvjax serve`: an OpenAI-compatible HTTP server (completions and chat completions, streamed by
server-sent events) over the continuous-batching engine, for an imported model's workdir.

  kvjax serve --workdir runs/smollm2 --port 8000 --press snapkv --ratio 0.5 --codec int8

then any OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`, model name
the workdir's folder name unless --model-name. The engine's settings beyond these options are
--set KEY=VALUE over kvjax.serving.config.EngineConfig (num_slots=16, num_pages=..., weights=int8,
cache.page_size=32, cache.press.window=32, cache.press.decode_budget=1024 (a pressed request then
holds at most 1024 + decode_interval tokens however long it generates), ...). By default the pool
holds num_slots requests of max_len tokens each.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import PRESSES, make_press
from kvjax.cli import options
from kvjax.fields import apply_overrides
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.serving.config import EngineConfig
from kvjax.serving.engine import Engine
from kvjax.training.checkpoint import load_model

DEFAULT_MAX_LEN = 4096


def engine_config(args: argparse.Namespace, model_max_len: int | None = None, stop_ids=()) -> EngineConfig:
  """The engine's settings from the options: --press, --ratio and --codec, then --set; without
  --set num_pages, a pool of num_slots requests of max_len tokens (max_len: the model's, at most
  DEFAULT_MAX_LEN). model_max_len None: the checks alone, before the model is loaded."""
  if args.ratio is not None and args.press is None:
    raise ValueError("--ratio sets the press's compression ratio; name the press with --press")
  press = None
  if args.press is not None:
    press = make_press(args.press, compression_ratio=0.5 if args.ratio is None else args.ratio)
  cache = CacheConfig(layout="paged" if press is None else "paged_evict", dtype=args.codec, press=press)
  max_len = min(model_max_len or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
  config = EngineConfig(num_slots=args.num_slots, max_len=max_len, cache=cache, stop_ids=tuple(stop_ids))
  config = apply_overrides(config, args.overrides)
  if not any(item.partition("=")[0].strip() == "num_pages" for item in args.overrides):
    per_request = -(-config.max_len // config.cache.page_size)
    config = dataclasses.replace(config, num_pages=config.num_slots * per_request + 1)
  return config


def command(args: argparse.Namespace) -> int:
  import uvicorn

  from kvjax.serving.server import create_app
  from kvjax.serving.worker import EngineWorker

  engine_config(args)  # a bad option is refused before the model loads
  model, params, _ = load_model(args.workdir)
  tokenizer = TextTokenizer.load(args.workdir, model.config.vocab_size)
  if tokenizer is None:
    raise ValueError(f"--workdir {args.workdir}: serving needs a model with a tokenizer (an imported model)")
  config = engine_config(args, model.config.max_len, tokenizer.stop_ids)
  config = dataclasses.replace(config, cache=config.cache.bind(tokenizer))
  engine = Engine(model, params, config)
  name = args.model_name or Path(args.workdir).resolve().name
  print(f"kvjax serve: {name} on http://{args.host}:{args.port}/v1 ({config})", file=sys.stderr, flush=True)
  worker = EngineWorker(engine)
  try:
    uvicorn.run(create_app(worker, tokenizer, name), host=args.host, port=args.port, log_level="warning")
  finally:
    worker.close()
  return 0


def _ratio(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
  if not 0 <= value < 1:
    raise argparse.ArgumentTypeError(f"must be a compression ratio in [0, 1), got {text}")
  return value


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API (completions, chat completions)")
  parser.add_argument("--workdir", required=True, type=options.workdir_text, help="an imported model's workdir")
  parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
  parser.add_argument("--port", type=options.port, default=8000, help="TCP port")
  parser.add_argument(
    "--model-name", type=options.nonempty_text, help="the model name clients send (default: the workdir's name)"
  )
  parser.add_argument("--num-slots", type=options.positive_int, default=8, help="requests decoded together")
  parser.add_argument("--press", choices=sorted(PRESSES), help="compress every prompt's cache with this press")
  parser.add_argument("--ratio", type=_ratio, help="the press's compression ratio (default 0.5)")
  parser.add_argument(
    "--codec", help="the cache's codec: int8, int4, float8_e4m3fn, bfloat16, ... (default: the model's dtype)"
  )
  options.add_set_option(parser)
  parser.set_defaults(func=command)
