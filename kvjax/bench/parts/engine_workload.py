"""The engine workload of `kvjax bench engine` and of the engine part of `kvjax bench real`: a seeded
workload of chat requests arriving over time, served by kvjax.Engine and by transformers
(kvjax.bench.peers.hf_engine: continuous batching, or padded static batching where that cannot finish
within the time limit), both with the weights in the same format. Every request makes exactly its
count of new tokens, greedy, on both sides. Reported for each side: requests and tokens per second,
time to first token, per-request latency (arrival to last token) and per-token latency (p50 / p99),
all from the times each request's tokens appeared; and the greedy agreement of the two sides'
answers, request by request."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvjax.bench.peers.hf_engine import peer_model, run_continuous, run_static
from kvjax.bench.base.harness import greedy_agreement
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
  """Requests/s, tokens/s, time to first token, per-request latency (arrival to last token) and
  per-token latency (p50, p99), from each request's arrival and the times its tokens appeared
  (seconds from the workload's start)."""
  ttft = [s[0] - a for a, s in zip(arrivals, stamps)]
  latency = [s[-1] - a for a, s in zip(arrivals, stamps)]
  per_token = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
  out = {"requests": len(stamps), "requests_per_s": len(stamps) / total_s, "tokens_per_s": sum(new_counts) / total_s}
  out["seconds"] = total_s
  for name, values in (("ttft", ttft), ("latency", latency), ("per_token", per_token)):
    for q in (50, 99):
      out[f"{name}_p{q}_s"] = float(np.percentile(values, q))
  return out


def run_kvjax_engine(model, params, requests, engine_config: EngineConfig) -> dict:
  """The requests through kvjax.Engine, each submitted at its arrival time -> {"stamps": [[token
  times, s from the start]], "tokens": [[ids]]} in request order."""
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
  tokens = {ids[i]: [int(t) for t in r.generated] for i, r in engine.finished.items()}
  return {
    "stamps": [stamps[i] for i in range(len(requests))],
    "tokens": [tokens[i] for i in range(len(requests))],
    "max_running": engine.stats.max_running,
  }


def engine_config(weights: str, mixed_steps: bool = True) -> EngineConfig:
  """16 rows, pages for 16 requests of the workload's longest context (768 tokens)."""
  return EngineConfig(
    num_slots=16,
    num_pages=16 * 48 + 1,
    max_len=768,
    cache=CacheConfig(layout="paged", page_size=16),
    weights=weights,
    mixed_steps=mixed_steps,
  )


def run_peer(hf_model, requests, weights: str, time_limit: float, peer: str) -> dict:
  """transformers on the requests in `weights`: continuous batching unless peer == "static" or it
  times out, then padded static batching; "peer" and "reason" say which ran and why."""
  model = peer_model(hf_model, weights)
  reason = "asked for static batching"
  if peer == "continuous":
    out = run_continuous(model, requests, time_limit, max_concurrent=16)
    if "timed_out" not in out:
      return {**out, "peer": "continuous batching"}
    reason = f"continuous batching did not finish: {out['timed_out']}"
  out = run_static(model, requests, time_limit, max_batch=16)
  return {**out, "peer": "padded static batching", "reason": reason}


def summary(requests, stamps, start: float = 0.0) -> dict:
  stamps = [[t - start for t in s] for s in stamps]
  total = max(s[-1] for s in stamps)
  return latency_summary([r[0] for r in requests], stamps, total, [len(s) for s in stamps])


def bench_engine(
  model,
  params,
  tokenizer,
  hf_model,
  workload: Workload,
  *,
  weights: str = "float32",
  time_limit: float = 1800.0,
  peer: str = "continuous",
  steps: tuple[str, ...] = ("mixed",),
) -> dict:
  """kvjax.Engine and its peer on the workload, the weights in `weights` on both sides. `steps`:
  the engine's runs in order, "mixed" (EngineConfig.mixed_steps) or "separate" (a context's chunk
  in a call of its own); the first is "kvjax", each later one "kvjax_<steps>_<i>" beside its ratio
  of tokens per second over the first's. peer "none": the engine alone."""
  requests = workload.build(tokenizer)
  config = engine_config(weights, steps[0] == "mixed")
  ours = run_kvjax_engine(model, params, requests, config)
  result = {
    "workload": dataclasses.asdict(workload),
    "weights": weights,
    "engine": dataclasses.asdict(config),
    "kvjax": summary(requests, ours["stamps"]),
  }
  for i, kind in enumerate(steps[1:], 1):
    again = run_kvjax_engine(model, params, requests, engine_config(weights, kind == "mixed"))
    result[f"kvjax_{kind}_{i}"] = summary(requests, again["stamps"])
    result[f"kvjax_{kind}_{i}"]["same_answers_as_first"] = sum(a == b for a, b in zip(again["tokens"], ours["tokens"]))
    result[f"tokens_per_s_{kind}_{i}_over_first"] = (
      result[f"kvjax_{kind}_{i}"]["tokens_per_s"] / result["kvjax"]["tokens_per_s"]
    )
  if peer == "none":
    return result
  theirs = run_peer(hf_model, requests, weights, time_limit, peer)
  served = len(theirs["stamps"])
  result |= {
    "hf": {
      "peer": theirs["peer"],
      **{k: theirs[k] for k in ("reason", "timed_out") if k in theirs},
      "settings": theirs["settings"],
      **summary(requests[:served], theirs["stamps"], theirs["start"]),
    },
    "agreement": greedy_agreement(ours["tokens"][:served], theirs["tokens"]),
  }
  result["requests_per_s_over_hf"] = result["kvjax"]["requests_per_s"] / result["hf"]["requests_per_s"]
  result["latency_p99_over_hf"] = result["kvjax"]["latency_p99_s"] / result["hf"]["latency_p99_s"]
  return result
