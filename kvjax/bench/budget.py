"""`kvjax bench budget --model NAME`: decoding in bounded memory, an evicting cache pressed back to
a budget every `interval` tokens (a press's decode_budget, kvjax.cache.selection).

Reported, as JSON:
  perplexity   held-out prose (kvjax.training.data's "prose" corpus, the model's tokenizer): the
               first `length` + 1 tokens of the held-out text, teacher-forced in calls of
               `interval` tokens, through the full cache and through each press at `budget`.
               A call of `interval` tokens under a budget reads what `interval` decode steps
               between two pressings read (the budget and the tokens since), and TOVA's and H2O's
               decode-time rules score alike (the last query's attention; the attention summed
               over the calls' queries), so this is the generation's own perplexity.
  generation   a `length`-token greedy generation under the budget with the press `generate`
               (TOVA's decode-time rule by default): its seconds, and the cache's bytes for
               generations of length / 2, 3 length / 4 and `length` tokens (constant) beside the full cache's.
  step_ms      a decode step under the budget (reads by positions in XLA; TOVA and H2O also
               compute the step's attention weights) beside an evicting cache of as many held
               tokens read through kvjax's decode kernel (no budget), in alternating rounds.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from kvjax.bench.peers.hf_model import check_source
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Kind, Option
from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.fill import filled_evicted
from kvjax.cache.presses import PRESSES, make_press
from kvjax.decoding import decode
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.timing import timed_alternating
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset

PRESS_NAMES = ("streaming_llm", "tova", "observed", "knorm", "snapkv")


def budget_config(press: str, budget: int, interval: int) -> CacheConfig:
  """A cache pressed by `press` to `budget` every `interval` tokens, prompts in chunks of `interval`."""
  return CacheConfig(press=make_press(press, decode_budget=budget, decode_interval=interval, prefill_chunk=interval))


def teacher_forced_loss(model, params, tokens: np.ndarray, cache_config: CacheConfig, interval: int) -> float:
  """Mean next-token loss (nats) of tokens int[n + 1] fed in calls of `interval` through a cache."""
  n = tokens.shape[0] - 1
  cache = kinds.create(model.config, cache_config, 1, n, prompt=interval)
  total = 0.0
  for start in range(0, n, interval):
    part = tokens[start : min(start + interval, n)]
    logits, cache = decode.extend(model, params, cache, part[None], [part.shape[0]])
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
    targets = tokens[start + 1 : start + 1 + part.shape[0]]
    total -= float(np.asarray(logp)[np.arange(part.shape[0]), targets].sum())
  return total / n


def bench_budget(
  source: str,
  *,
  length: int = 4096,
  budget: int = 1024,
  interval: int = 64,
  presses=PRESS_NAMES,
  generate: str = "tova",
  repeats: int = 5,
) -> dict:
  params, config, tokenizer, path = read_model(source)
  model = Transformer(config)
  data = load_dataset(DataConfig(source=PROSE, seq_len=length), tokenizer)
  if data.val.shape[0] < length + 1:
    raise ValueError(f"the held-out prose holds {data.val.shape[0]} tokens, fewer than length + 1 = {length + 1}")
  text = np.asarray(data.val[: length + 1], np.int32)
  losses = {"full": teacher_forced_loss(model, params, text, CacheConfig(), interval)}
  for press in presses:
    losses[press] = teacher_forced_loss(model, params, text, budget_config(press, budget, interval), interval)
  perplexity = {name: math.exp(loss) for name, loss in losses.items()}

  generating = budget_config(generate, budget, interval)
  prompt = text[None, :interval]
  start = time.perf_counter()
  out = decode.generate(model, params, prompt, [interval], length, cache_config=generating)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  max_len = lambda n: interval + n - 1
  cache_bytes = {
    str(n): kinds.cache_bytes(config, generating, 1, max_len(n), prompt=interval)
    for n in (length // 2, 3 * length // 4, length)
  }

  # Decode steps over caches holding `budget` random tokens of a `context`-token history.
  context, steps = length + interval, 2 * repeats + 4
  ratio = 1 - budget / context
  caches = {
    "kernel_no_budget": filled_evicted(
      config, CacheConfig(press=make_press(generate, compression_ratio=ratio)), 1, context, context + steps
    )
  }
  for press in dict.fromkeys(("streaming_llm", generate)):
    pressed = make_press(press, compression_ratio=ratio, decode_budget=budget, decode_interval=interval)
    caches[f"budget_{press}"] = filled_evicted(config, CacheConfig(press=pressed), 1, context, context + steps)
  tokens = np.zeros((1,), np.int32)

  def step(name):
    def run():
      logits, caches[name] = decode.decode_step(model, params, caches[name], tokens)
      return logits

    return run

  times = timed_alternating({name: step(name) for name in caches}, repeats)
  step_ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
  return {
    "benchmark": "budget",
    "source": str(path),
    "corpus": PROSE,
    "length": length,
    "budget": budget,
    "interval": interval,
    "loss": losses,
    "perplexity": perplexity,
    "perplexity_relative": {name: value / perplexity["full"] - 1 for name, value in perplexity.items()},
    "generation": {
      "press": generate,
      "tokens": int(out.shape[1]),
      "seconds": seconds,
      "cache_bytes": cache_bytes,
      "full_cache_bytes": kinds.cache_bytes(config, CacheConfig(), 1, max_len(length)),
    },
    "step_ms": step_ms,
  }


def run(*, model: str, length: int, budget: int, interval: int, presses: list, generate: list, repeats: int) -> dict:
  check_source(model)
  if len(generate) != 1:
    raise ValueError(f"--generate takes one press, got {','.join(generate)}")
  return bench_budget(
    model, length=length, budget=budget, interval=interval, presses=presses, generate=generate[0], repeats=repeats
  )


BENCHMARK = Benchmark(
  name="budget",
  summary="decoding in bounded memory: perplexity and memory of a long generation pressed to a budget",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("length", 4096, "tokens generated (and of held-out prose teacher-forced)"),
    Option("budget", 1024, "tokens a row holds after each pressing (decode_budget)"),
    Option("interval", 64, "tokens between pressings (decode_interval, prefill_chunk)"),
    Option("presses", list(PRESS_NAMES), "comma-separated presses scored at the budget", Kind.NAMES, tuple(PRESSES)),
    Option("generate", ["tova"], "the press of the timed generation (one)", Kind.NAMES, tuple(PRESSES)),
    Option("repeats", 5, "alternating timed rounds of the decode steps (median)"),
  ),
  description=__doc__,
)
