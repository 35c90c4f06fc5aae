"""`kvjax bench load --model smollm2-135m`: a bounded load test of `kvjax serve` on loopback, through
the `openai` client, that checks nothing is lost and reports what the server sustains.

A seeded mix of requests, sent by `clients` concurrent clients as fast as they are answered:
completions over a set of distinct prompts (half of them opening with one shared document),
streamed or whole, of mixed prompt and answer lengths, all greedy; some cancelled by their client
after a few events; a few that can never fit the page pool (refused with a 400, the server going
on). The pool is small for the rows, so the engine runs out of free pages and, when the rows it
runs happen to grow together, preempts.

Checked at the end (the JSON's "checks", each true or the first failure): every finished answer is
the text of `generate`'s greedy tokens for its prompt and length; every cancelled answer is a prefix
of it; exactly the oversize requests were refused; no more cancels reached the engine than clients
left (fewer: a client that left after its last token was made); every page is free and the allocator
consistent; the worker and the engine hold no request; the server's resident memory at the end is
within 10% of what it was after the first tenth of the requests. Reported: requests and tokens
per second, time to first token and per-token latency (p50 / p99; streamed requests), the
preemptions and the fewest free pages the pool had (its low-water mark).
"""

from __future__ import annotations

import dataclasses
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Option
from kvjax.cache.config import CacheConfig
from kvjax.decoding.decode import generate
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.serving.worker import EngineWorker
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset

MODEL = "load-test"


@dataclasses.dataclass(frozen=True)
class Load:
  """The requests (see the module docstring) and the engine they load: `num_slots` rows over a
  pool of `pool_tokens` token slots (pages of 16), max_len positions per request."""

  requests: int = 1000
  clients: int = 24
  distinct: int = 24
  prompt_tokens: tuple[int, int] = (16, 256)
  new_tokens: tuple[int, int] = (1, 48)
  stream: float = 0.5
  cancel: float = 0.1
  oversize: float = 0.02
  num_slots: int = 8
  pool_tokens: int = 1536
  max_len: int = 2048
  seed: int = 0

  def engine_config(self, stop_ids) -> EngineConfig:
    cache = CacheConfig(layout="paged", page_size=16)
    return EngineConfig(
      num_slots=self.num_slots,
      num_pages=self.pool_tokens // 16 + 1,
      max_len=self.max_len,
      cache=cache,
      stop_ids=tuple(stop_ids),
    )


def prompts(load: Load, tokenizer) -> list[list[int]]:
  """`distinct` prompts of prose, the even ones opening with one shared document."""
  rng = np.random.default_rng(load.seed)
  text = np.asarray(load_dataset(DataConfig(source=PROSE, seq_len=load.prompt_tokens[1]), tokenizer).val)
  shared = [int(t) for t in text[: load.prompt_tokens[1] // 2]]
  out = []
  for i in range(load.distinct):
    length = int(rng.integers(*load.prompt_tokens, endpoint=True))
    start = int(rng.integers(len(shared), len(text) - length))
    own = [int(t) for t in text[start : start + length]]
    out.append((shared + own)[: load.prompt_tokens[1]] if i % 2 == 0 else own)
  return out


def plan(load: Load, count: int) -> list[dict]:
  """Each request: its prompt's index, new tokens (an oversize one's are set by load_test), streamed, cancelled after how many events
  (None: read to the end), oversize. Exactly round(requests x oversize) are oversize and
  round(requests x cancel) cancelled (streamed), drawn at random; of the rest, `stream` streamed."""
  rng = np.random.default_rng(load.seed + 1)
  order = rng.permutation(load.requests)
  oversize = set(order[: round(load.requests * load.oversize)].tolist())
  cancel = set(order[len(oversize) : len(oversize) + round(load.requests * load.cancel)].tolist())
  out = []
  for i in range(load.requests):
    new = int(rng.integers(*load.new_tokens, endpoint=True))
    if i in cancel:  # the longest answers: most are still being made when their client leaves
      new = load.new_tokens[1]
    stream = i in cancel or bool(rng.random() < load.stream)
    out.append(
      {
        "prompt": int(rng.integers(count)),
        "new": new,
        "stream": stream,
        "cancel": 2 if i in cancel else None,
        "oversize": i in oversize,
      }
    )
  return out


def expected(model, params, prompts_ids: list[list[int]], max_new: int, stop_ids) -> list[list[int]]:
  """`generate`'s greedy tokens for each prompt alone (one row each, right-padded to one shape so
  that one compilation serves them all), up to and including a stop id."""
  width = max(len(p) for p in prompts_ids)
  out = []
  for prompt in prompts_ids:
    ids = np.zeros((1, width), np.int32)
    ids[0, : len(prompt)] = prompt
    tokens = [
      int(t) for t in np.asarray(generate(model, params, ids, np.array([len(prompt)]), max_new, stop_ids=stop_ids))[0]
    ]
    ends = [i for i, t in enumerate(tokens) if t in stop_ids]
    out.append(tokens[: ends[0] + 1] if ends else tokens)
  return out


def _rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def load_test(model: Transformer, params, tokenizer, load: Load = Load()) -> dict:
  """Serves `model` on a loopback port, runs the load against it and checks it (module docstring)."""
  import openai

  from kvjax.serving.server import create_app, running

  stops = tuple(int(t) for t in tokenizer.stop_ids)
  texts = prompts(load, tokenizer)
  requests = plan(load, len(texts))
  for r in requests:
    if r["oversize"]:  # a context of max_len positions: within max_len, beyond the pool
      r["new"] = load.max_len - len(texts[r["prompt"]]) + 1
  oracle = expected(model, params, texts, load.new_tokens[1], stops)  # an answer of n tokens: the first n

  engine = Engine(model, params, load.engine_config(stops))
  engine.warmup()  # every bucket compiled first: what memory grows by later is what the server keeps
  worker = EngineWorker(engine)
  with running(create_app(worker, tokenizer, MODEL)) as port:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=600)
    out = _drive(load, client, worker, requests, texts)
  worker.close()
  return report(load, requests, texts, oracle, tokenizer, **out)


def _drive(load: Load, client, worker: EngineWorker, requests: list[dict], texts: list[list[int]]) -> dict:
  """The requests sent by `load.clients` concurrent clients; what each got, and the engine's state
  once they are all answered."""
  import openai

  memory, done = [], threading.Event()

  def watch():  # resident memory, twice a second
    while not done.wait(0.5):
      memory.append((sum(1 for r in results if r is not None), _rss_mib()))

  results: list[dict | None] = [None] * len(requests)

  def send(i: int) -> None:
    r = requests[i]
    start = time.perf_counter()
    body = dict(model=MODEL, prompt=texts[r["prompt"]], max_tokens=r["new"], temperature=0)
    out = {"text": "", "stamps": [], "finish": None, "error": None, "tokens": None}
    try:
      if r["stream"]:
        stream = client.completions.create(**body, stream=True)
        for event in stream:
          out["stamps"].append(time.perf_counter() - start)
          out["text"] += event.choices[0].text
          out["finish"] = event.choices[0].finish_reason or out["finish"]
          if r["cancel"] is not None and len(out["stamps"]) >= r["cancel"] and out["finish"] is None:
            stream.close()
            out["finish"] = "cancelled"
            break
      else:
        answer = client.completions.create(**body)
        out["text"], out["finish"] = answer.choices[0].text, answer.choices[0].finish_reason
        out["tokens"] = answer.usage.completion_tokens
        out["stamps"].append(time.perf_counter() - start)
    except openai.BadRequestError as err:
      out["error"] = err.body.get("message") if isinstance(err.body, dict) else str(err)
    results[i] = out

  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  start = time.perf_counter()
  with ThreadPoolExecutor(load.clients) as pool:
    list(pool.map(send, range(len(requests))))
  seconds = time.perf_counter() - start
  done.set()
  watcher.join()
  state = worker.call(_state).result()
  for _ in range(100):  # a cancel is sent as its client leaves: give the last ones time to land
    if state["held"] == 0:
      break
    time.sleep(0.1)
    state = worker.call(_state).result()
  worker.call(lambda e: e.allocator.check()).result()
  return {
    "results": results,
    "seconds": seconds,
    "state": state,
    "memory": memory,
    "cancelled_by_worker": worker.cancelled,
    "live": worker.live,
  }


def _state(engine: Engine) -> dict:
  """What the engine holds and has counted (run on its thread)."""
  alloc, stats = engine.allocator, engine.stats
  return {
    "free": alloc.num_free,
    "usable": alloc.num_usable,
    "held": len(engine.running) + len(engine.waiting),
    "kept": len(engine.finished),
    "preemptions": stats.preemptions,
    "fewest_free": alloc.fewest_free,
    "prompt_tokens": stats.prompt_tokens,
    "cached_tokens": stats.cached_tokens,
  }


def report(
  load, requests, texts, oracle, tokenizer, *, results, seconds, state, memory, cancelled_by_worker, live
) -> dict:
  """The checks and figures (module docstring) from what _drive saw."""
  stops = set(tokenizer.stop_ids)
  checks, wrong = {}, []
  finished = cancelled = refused = tokens = 0
  ttft, per_token = [], []
  for i, (r, out) in enumerate(zip(requests, results)):
    if r["oversize"]:
      refused += out["error"] is not None
      if out["error"] is None or "pages" not in out["error"]:
        wrong.append(f"request {i}: oversize, not refused for the pool: {out['error'] or out['finish']}")
      continue
    if out["error"] is not None:
      wrong.append(f"request {i}: refused: {out['error']}")
      continue
    want_ids = oracle[r["prompt"]][: r["new"]]
    want = tokenizer.decode([t for t in want_ids if t not in stops])
    if out["finish"] == "cancelled":
      cancelled += 1
      if not want.startswith(out["text"]):
        wrong.append(f"request {i}: cancelled answer {out['text']!r} is not a prefix of {want!r}")
      continue
    finished += 1
    tokens += len(want_ids)
    if out["text"] != want:
      wrong.append(f"request {i}: {out['text']!r} != generate's {want!r}")
    if r["stream"] and len(out["stamps"]) > 1:
      ttft.append(out["stamps"][0])
      per_token.append((out["stamps"][-1] - out["stamps"][0]) / max(1, len(want_ids) - 1))
  free_now, usable, held, kept = state["free"], state["usable"], state["held"], state["kept"]
  checks["answers equal generate"] = wrong[0] if wrong else True
  checks["every page free"] = True if free_now == usable else f"{usable - free_now} of {usable} pages held"
  checks["no request held"] = (
    True
    if held == kept == live == 0
    else f"engine {held} running or waiting, {kept} finished records, worker {live} live"
  )
  # A client can leave after its answer's last token was made and before it was read: that
  # request finished in the engine, and its cancel finds nothing to do.
  checks["no cancel beyond the clients'"] = (
    True if cancelled_by_worker <= cancelled else f"{cancelled_by_worker} cancels for {cancelled} clients"
  )
  settled = [m for n, m in memory if n >= len(requests) // 10]
  growth = (settled[-1] / settled[0] - 1) if len(settled) > 1 else 0.0
  checks["memory flat"] = True if growth <= 0.10 else f"resident memory grew {100 * growth:.1f}% after the first tenth"
  out = {
    "benchmark": "load",
    "load": dataclasses.asdict(load),
    "checks": checks,
    "wrong": len(wrong),
    "finished": finished,
    "cancelled": cancelled,
    "cancelled_in_engine": cancelled_by_worker,
    "refused": refused,
    "seconds": seconds,
    "requests_per_s": (finished + cancelled) / seconds,
    "tokens_per_s": tokens / seconds,
    "preemptions": state["preemptions"],
    "prompt_tokens": state["prompt_tokens"],
    "prefix_cached_tokens": state["cached_tokens"],
    "fewest_free_pages": state["fewest_free"],
    "pool_pages": usable,
    "resident_mib_first_tenth": settled[0] if settled else None,
    "resident_mib_end": settled[-1] if settled else None,
  }
  for name, values in (("ttft", ttft), ("per_token", per_token)):
    for q in (50, 99):
      out[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if values else None
  return out


def run(*, model: str, requests: int, clients: int) -> dict:
  params, config, tokenizer, _ = read_model(model)
  if tokenizer is None:
    raise ValueError(f"{model} has no tokenizer; the load test sends text")
  return load_test(Transformer(config), params, tokenizer, Load(requests=requests, clients=clients))


BENCHMARK = Benchmark(
  name="load",
  summary="a bounded load test of `kvjax serve` over loopback (nothing lost, pages freed, latency)",
  description=__doc__,
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("requests", 1000, "requests in the load"),
    Option("clients", 24, "concurrent clients"),
  ),
)
