"""The peer of the engine workload: transformers serving the same timed requests, in the same
weight format as kvjax's engine, under a time limit.

First transformers' continuous batching (`init_continuous_batching`, its paged cache and FIFO
scheduler in a background thread). Its defaults are sized for a GPU: on CPU the pool takes 60% of
the free host memory, and without flash attention the dense mask buffer [max_batch_tokens, pool
tokens + max_batch_tokens] and the read indices grow with it. Here the pool holds the workload's
concurrent requests and nothing more, with SDPA attention (flash attention runs only in half
precision on a GPU; float32 and int8 have no other choice) and torch's threads set by the caller.
Where it cannot serve every request within the time limit, the same requests go through padded
static batching: the requests that have arrived when the previous batch ends form the next batch (at
most `max_batch`), padded on the left, and one `generate` with a static cache makes the longest
request's count of tokens for all of them. The result says which peer ran and why.

Both peers produce exactly each request's count of new tokens, greedy, no stop token, and
record the time of every token, so kvjax.bench.parts.engine_workload.latency_summary reads both sides
the same way.
"""

from __future__ import annotations

import time

from kvjax.bench.peers.hf_model import import_torch

CB_PAGE_SIZE = 256


def peer_model(hf_model, weights: str):
  """transformers' float32 model in `weights`: float32 as is, bfloat16 a copy cast, int8 torch's
  dynamic int8 quantization of the Linear layers (the format closest to kvjax's int8 weights)."""
  import copy

  torch, _ = import_torch()
  if weights == "float32":
    return hf_model
  if weights == "bfloat16":
    return copy.deepcopy(hf_model).to(torch.bfloat16)
  if weights == "int8":
    return torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf_model), {torch.nn.Linear}, dtype=torch.qint8)
  raise ValueError(f"the engine's peer has no weight format {weights!r}; choose float32, bfloat16 or int8")


def cb_settings(requests, max_concurrent: int) -> dict:
  """The continuous-batching settings: a cache of pages for `max_concurrent` of the longest requests,
  at most `max_concurrent` requests and 256 query tokens (a prefill chunk) per step."""
  longest = max(len(prompt) + new for _, prompt, new in requests)
  pages = -(-longest // CB_PAGE_SIZE) + 1
  return dict(
    page_size=CB_PAGE_SIZE,
    num_blocks=pages * max_concurrent,
    max_batch_tokens=256,
    max_requests_per_batch=max_concurrent,
    allow_block_sharing=False,
  )


def run_continuous(hf_model, requests, time_limit: float, max_concurrent: int) -> dict:
  """The requests through transformers' continuous batching, each added at its arrival time.
  Returns {"start": perf_counter at time 0, "stamps": [[token times]], "tokens": [[ids]],
  "settings"} or {"timed_out": reason} when the limit passes first or a request fails."""
  torch, transformers = import_torch()
  settings = cb_settings(requests, max_concurrent)
  generation = transformers.GenerationConfig(
    do_sample=False, max_new_tokens=max(r[2] for r in requests), eos_token_id=-1, pad_token_id=0
  )
  manager = hf_model.init_continuous_batching(
    generation_config=generation, continuous_batching_config=transformers.ContinuousBatchingConfig(**settings)
  )
  settings["attn_implementation"] = hf_model.config._attn_implementation
  manager.start()
  start = time.perf_counter()
  deadline = start + time_limit
  results = {}
  try:
    ids = []
    for arrival, prompt, new in requests:
      time.sleep(max(0.0, arrival - (time.perf_counter() - start)))
      ids.append(manager.add_request(prompt, max_new_tokens=new, record_timestamps=True))
    for request_id in ids:
      result = manager.get_result(request_id=request_id, timeout=max(0.0, deadline - time.perf_counter()))
      if result is None:
        return {"timed_out": f"{len(results)} of {len(ids)} requests done after the {time_limit:.0f} s limit"}
      if result.error is not None:
        return {"timed_out": f"request {request_id} failed: {result.error}"}
      results[request_id] = result
  finally:
    manager.stop(block=True, timeout=60, hard_stop=len(results) < len(requests))
  return {
    "start": start,
    "stamps": [results[i].timestamps for i in ids],
    "tokens": [list(results[i].generated_tokens) for i in ids],
    "settings": settings,
  }


class _TokenTimes:
  """A generate streamer recording when each step's tokens appear (its first call is the prompt)."""

  def __init__(self):
    self.times: list[float] = []
    self.calls = 0

  def put(self, value):
    self.calls += 1
    if self.calls > 1:
      self.times.append(time.perf_counter())

  def end(self):
    pass


def run_static(hf_model, requests, time_limit: float, max_batch: int) -> dict:
  """The requests through padded static batching (see the module docstring), as run_continuous
  returns them; requests not started within the limit are left out ("timed_out" says how many)."""
  torch, _ = import_torch()
  start = time.perf_counter()
  stamps, tokens = [None] * len(requests), [None] * len(requests)
  done = 0
  while done < len(requests):
    now = time.perf_counter() - start
    if now > time_limit:
      break
    time.sleep(max(0.0, requests[done][0] - now))
    now = time.perf_counter() - start
    batch = [i for i in range(done, min(len(requests), done + max_batch)) if requests[i][0] <= now]
    width = max(len(requests[i][1]) for i in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(batch):
      prompt = requests[i][1]
      ids[row, width - len(prompt) :] = torch.tensor(prompt)
      mask[row, width - len(prompt) :] = 1
    new = max(requests[i][2] for i in batch)
    streamer = _TokenTimes()
    with torch.no_grad():
      out = hf_model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
        eos_token_id=None,
        streamer=streamer,
      )
    for row, i in enumerate(batch):
      count = requests[i][2]
      stamps[i] = streamer.times[:count]
      tokens[i] = [int(t) for t in out[row, width : width + count]]
    done = batch[-1] + 1
  result = {"start": start, "stamps": stamps[:done], "tokens": tokens[:done], "settings": {"max_batch": max_batch}}
  if done < len(requests):
    result["timed_out"] = f"{done} of {len(requests)} requests started within the {time_limit:.0f} s limit"
  return result
