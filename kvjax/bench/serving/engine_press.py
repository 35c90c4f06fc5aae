"""`kvjax bench engine_press --model smollm2-135m`: eviction in the engine, at a fixed page pool.

Two parts, each run without a press (layout "paged") and with one (layout "paged_evict",
--press at --ratio-percent / 100), on the same pool:
  capacity: --requests prompts of --prompt tokens of held-out prose (--new-tokens each, greedy)
    submitted at once to an engine of --pool-pages pages of 16 tokens: the requests its first step
    admits and runs at once, and the pages they hold; then all of them served to the end, timed
    (requests and tokens per second: what the concurrency a press buys is worth);
  chat: the chat workload of `kvjax bench engine` (kvjax.bench.parts.engine_workload; --chat-requests
    requests, Poisson arrivals) through an engine of --chat-pool-pages pages: requests and tokens
    per second, latencies, and the most requests running at once.
With --decode-budget N the press also presses each request back to N tokens as it decodes (every
--decode-interval tokens; kvjax.cache.selection), so a long generation holds at most N + interval
slots: `--prompt 256 --new-tokens 1024 --decode-budget 256` measures what that buys.
A press changes the answers (it drops tokens), so no agreement is reported; its oracle is the
engine's tests (the engine with a press gives `generate`'s tokens with that press).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvjax.bench.parts.engine_workload import Workload, run_kvjax_engine, summary
from kvjax.bench.peers.hf_model import prose_prompts
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import PRESSES, make_press
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.serving.engine import Engine, EngineConfig

PAGE = 16
CHAT_MAX_LEN = 768  # the chat workload's longest context (512 + 256)


def cache_for(press) -> CacheConfig:
  return CacheConfig(layout="paged" if press is None else "paged_evict", page_size=PAGE, press=press)


def capacity(model, params, prompts: np.ndarray, pool_pages: int, press, new_tokens: int) -> dict:
  """Every prompt (int[R, L]) submitted at once to one engine of `pool_pages` pages: the requests
  its first step admits (each prefilled, then one decode step for all); then the rest, to the end."""
  rows, length = prompts.shape
  config = EngineConfig(num_slots=rows, num_pages=pool_pages, max_len=length + new_tokens, cache=cache_for(press))
  engine = Engine(model, params, config)
  for prompt in prompts:
    engine.submit(prompt, new_tokens)
  start = time.perf_counter()
  engine.step()
  first = time.perf_counter() - start
  out = {
    "max_running": len(engine.running),
    "pages_held": engine.allocator.num_usable - engine.allocator.num_free,
    "pages_usable": engine.allocator.num_usable,
    "first_step_seconds": first,
  }
  served = engine.run()
  seconds = time.perf_counter() - start
  generated = sum(len(t) for t in served.values())
  return out | {"seconds": seconds, "requests_per_s": len(served) / seconds, "tokens_per_s": generated / seconds}


def chat(model, params, requests, pool_pages: int, press) -> dict:
  """The chat workload through an engine of `pool_pages` pages."""
  config = EngineConfig(num_slots=16, num_pages=pool_pages, max_len=CHAT_MAX_LEN, cache=cache_for(press))
  served = run_kvjax_engine(model, params, requests, config)
  return summary(requests, served["stamps"]) | {"max_running": served["max_running"]}


def run(
  *,
  model: str,
  press: list[str],
  ratio_percent: int,
  prompt: int,
  new_tokens: int,
  requests: int,
  pool_pages: int,
  chat_requests: int,
  chat_pool_pages: int,
  decode_budget: int,
  decode_interval: int,
) -> dict:
  if len(press) != 1:
    raise ValueError(f"--press takes one press, got {','.join(press)}")
  if not 0 < ratio_percent < 100:
    raise ValueError(f"--ratio-percent must be in (0, 100), got {ratio_percent}")
  chosen = make_press(
    press[0], compression_ratio=ratio_percent / 100, decode_budget=decode_budget, decode_interval=decode_interval
  )
  params, config, tokenizer, path = read_model(model)
  transformer = Transformer(config)
  workload = Workload(requests=max(1, chat_requests))
  chat_requests_built = workload.build(tokenizer)
  out = {"benchmark": "engine_press", "source": str(path), "press": repr(chosen), "page_size": PAGE}
  out["capacity"] = {"prompt_tokens": prompt, "new_tokens": new_tokens, "requests": requests, "pool_pages": pool_pages}
  if requests:
    prompts = prose_prompts(tokenizer, requests, prompt)
    for name, value in (("full", None), ("pressed", chosen)):
      out["capacity"][name] = capacity(transformer, params, prompts, pool_pages, value, new_tokens)
    full, pressed = out["capacity"]["full"], out["capacity"]["pressed"]
    for key in ("max_running", "requests_per_s", "tokens_per_s"):
      out["capacity"][f"{key}_over_full"] = pressed[key] / full[key]
  if not chat_requests:
    return out
  out["chat"] = {"workload": dataclasses.asdict(workload), "pool_pages": chat_pool_pages}
  for name, value in (("full", None), ("pressed", chosen)):
    out["chat"][name] = chat(transformer, params, chat_requests_built, chat_pool_pages, value)
  full, pressed = out["chat"]["full"], out["chat"]["pressed"]
  for key in ("max_running", "requests_per_s", "tokens_per_s"):
    out["chat"][f"{key}_over_full"] = pressed[key] / full[key]
  return out


BENCHMARK = Benchmark(
  name="engine_press",
  summary="eviction in the engine: concurrent long prompts and chat throughput at a fixed page pool",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("press", ["snapkv"], "the press", Kind.NAMES, choices=tuple(PRESSES)),
    Option("ratio_percent", 75, "the press's compression ratio, in percent"),
    Option("prompt", 2048, "prompt tokens of each capacity request"),
    Option("new_tokens", 128, "tokens each capacity request generates"),
    Option("requests", 16, "capacity requests, submitted at once (0: no capacity part)", Kind.NONNEGATIVE),
    Option("pool_pages", 513, "pages of 16 tokens of the capacity engine (the null page included)"),
    Option(
      "chat_requests", 24, "requests of the chat workload (4 per second on average; 0: no chat part)", Kind.NONNEGATIVE
    ),
    Option("chat_pool_pages", 97, "pages of 16 tokens of the chat engine (the null page included)"),
    Option(
      "decode_budget", 0, "tokens a pressed request holds while it decodes (0: every generated token)", Kind.NONNEGATIVE
    ),
    Option("decode_interval", 1, "generated tokens between two pressings under --decode-budget"),
  ),
  description=__doc__,
)
