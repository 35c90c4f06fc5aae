"""The engine part of `kvjax bench real`: a seeded workload of chat requests arriving over time,
run by kvjax.Engine and by transformers' continuous batching, with requests and tokens per second,
time to first token and per-token latency taken from each request's token times."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvjax.bench.real_model import import_torch
from kvjax.cache.config import CacheConfig
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset


@dataclasses.dataclass(frozen=True)
class Workload:
  """Seeded chat requests: prose in the chat template, prompt and new-token counts uniform in
  their ranges, arrivals a Poisson process of `rate` requests per second."""

  requests: int = 64
  prompt_tokens: tuple[int, int] = (32, 512)
  new_tokens: tuple[int, int] = (32, 256)
  rate: float = 4.0
  seed: int = 0

  def build(self, tokenizer) -> list[tuple[float, list[int], int]]:
    """[(arrival s, prompt ids, new tokens)]."""
    rng = np.random.default_rng(self.seed)
    text = load_dataset(DataConfig(source=PROSE, seq_len=self.prompt_tokens[1]), tokenizer).val
    arrivals = np.cumsum(rng.exponential(1 / self.rate, self.requests))
    out = []
    for arrival in arrivals:
      length = int(rng.integers(*self.prompt_tokens, endpoint=True))
      start = int(rng.integers(0, len(text) - length))
      body = tokenizer.decode(list(np.asarray(text[start : start + length])))
      chat = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True)
      ids = tokenizer.encode(chat)[: self.prompt_tokens[1]]
      out.append((float(arrival), [int(t) for t in ids], int(rng.integers(*self.new_tokens, endpoint=True))))
    return out


def latency_summary(arrivals, stamps, total_s, new_counts) -> dict:
  """Requests/s, tokens/s, time to first token and per-token latency (p50, p95) from each
  request's arrival and the times its tokens appeared."""
  ttft = [s[0] - a for a, s in zip(arrivals, stamps)]
  per_token = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
  pct = lambda xs, q: float(np.percentile(xs, q))
  return {
    "requests_per_s": len(stamps) / total_s,
    "tokens_per_s": sum(new_counts) / total_s,
    "seconds": total_s,
    "ttft_p50_s": pct(ttft, 50),
    "ttft_p95_s": pct(ttft, 95),
    "per_token_p50_s": pct(per_token, 50),
    "per_token_p95_s": pct(per_token, 95),
  }


def run_kvjax_engine(model, params, requests, engine_config: EngineConfig) -> dict:
  engine = Engine(model, params, engine_config)
  engine.warmup()
  start = time.perf_counter()
  pending = list(enumerate(requests))
  stamps: dict[int, list[float]] = {}
  ids: dict[int, int] = {}
  while pending or engine.waiting or engine.running:
    now = time.perf_counter() - start
    while pending and pending[0][1][0] <= now:
      index, (_, prompt, new) = pending.pop(0)
      ids[engine.submit(np.asarray(prompt, np.int32), new)] = index
    if not (engine.waiting or engine.running):
      time.sleep(max(0.0, pending[0][1][0] - now))
      continue
    engine.step()
    now = time.perf_counter() - start
    for request in [*engine.running, *engine.finished.values()]:
      times = stamps.setdefault(ids[request.id], [])
      times.extend([now] * (len(request.generated) - len(times)))
  total = time.perf_counter() - start
  order = sorted(stamps)
  return latency_summary(
    [requests[i][0] for i in order], [stamps[i] for i in order], total, [requests[i][2] for i in order]
  )


def run_hf_engine(hf_model, requests) -> dict:
  _, transformers = import_torch()
  generation = transformers.GenerationConfig(
    do_sample=False, max_new_tokens=max(r[2] for r in requests), eos_token_id=None
  )
  manager = hf_model.init_continuous_batching(generation_config=generation)
  manager.start()
  try:
    start = time.perf_counter()
    ids = []
    for arrival, prompt, new in requests:
      time.sleep(max(0.0, arrival - (time.perf_counter() - start)))
      ids.append(manager.add_request(prompt, max_new_tokens=new, record_timestamps=True))
    results = {}
    for request_id in ids:
      results[request_id] = manager.get_result(request_id=request_id, timeout=3600)
    total = time.perf_counter() - start
  finally:
    manager.stop(block=True)
  stamps = [[t - start for t in results[i].timestamps] for i in ids]
  return latency_summary([r[0] for r in requests], stamps, total, [len(results[i].generated_tokens) for i in ids])


def bench_engine(model, params, tokenizer, hf_model, workload: Workload) -> dict:
  requests = workload.build(tokenizer)
  config = EngineConfig(
    num_slots=16, num_pages=16 * 48 + 1, max_len=768, cache=CacheConfig(layout="paged", page_size=16), weights="int8"
  )
  ours = run_kvjax_engine(model, params, requests, config)
  theirs = run_hf_engine(hf_model, requests)
  return {
    "workload": dataclasses.asdict(workload),
    "engine": dataclasses.asdict(config),
    "kvjax": ours,
    "hf": theirs,
    "requests_per_s_over_hf": ours["requests_per_s"] / theirs["requests_per_s"],
  }
