"""Continuous batching: every request gets exactly the tokens it would get alone."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.cache.config import CacheConfig
from kvjax.serving import mixed, steps
from kvjax.serving.engine import Engine, EngineConfig
from conftest import init_params, tiny_config

MAX_LEN = 48
PROMPT_PAD = 32
# 16 usable pages of 4 tokens: four slots of long requests cannot all fit, so requests are preempted.
CONFIG = EngineConfig(num_slots=4, num_pages=17, max_len=MAX_LEN, cache=CacheConfig(layout="paged", page_size=4))


@pytest.fixture(scope="module")
def model_params():
  return init_params(tiny_config(2))


def workload(seed: int, count: int = 9):
  rng = np.random.default_rng(seed)
  requests = []
  for _ in range(count):
    prompt = rng.integers(0, 64, int(rng.integers(1, 21)), dtype=np.int32)
    requests.append((prompt, int(rng.integers(1, MAX_LEN - prompt.size + 2))))
  return requests


def greedy_alone(model, params, prompt, max_new_tokens):
  """The contiguous cache, one request at a time, greedy."""
  tokens = np.zeros((1, PROMPT_PAD), np.int32)
  tokens[0, : prompt.size] = prompt
  logits, cache = kvjax.prefill(model, params, tokens, np.array([prompt.size]), max_len=MAX_LEN)
  out = [int(np.argmax(logits[0, prompt.size - 1]))]
  while len(out) < max_new_tokens:
    logits, cache = kvjax.decode_step(model, params, cache, np.array(out[-1:], np.int32))
    out.append(int(np.argmax(logits[0])))
  return np.array(out, np.int32)


def serve(model, params, requests, config=CONFIG, sampling=None):
  engine = Engine(model, params, config)
  ids = [engine.submit(prompt, n, sampling) for prompt, n in requests]
  outputs = engine.run()
  engine.allocator.check()
  assert engine.allocator.num_free == engine.allocator.num_usable  # every page came back
  return [outputs[i] for i in ids], engine


def test_every_request_matches_running_alone_whatever_the_order(model_params):
  model, params = model_params
  requests = workload(seed=0)
  want = [greedy_alone(model, params, prompt, n) for prompt, n in requests]
  forward, engine = serve(model, params, requests)
  assert engine.stats.preemptions > 0  # recompute after preemption is exercised
  assert engine.stats.max_running > 1
  backward, _ = serve(model, params, requests[::-1])
  for i, tokens in enumerate(want):
    np.testing.assert_array_equal(forward[i], tokens)
    np.testing.assert_array_equal(backward[len(requests) - 1 - i], tokens)


@pytest.mark.parametrize("allocation", ["doubling", "max_len"])
def test_allocation_policies_change_memory_not_tokens(model_params, allocation):
  model, params = model_params
  requests = workload(seed=1, count=6)
  paged, paged_engine = serve(model, params, requests)
  other, engine = serve(model, params, requests, EngineConfig(**{**vars(CONFIG), "allocation": allocation}))
  for a, b in zip(paged, other):
    np.testing.assert_array_equal(a, b)
  assert engine.stats.utilisation < paged_engine.stats.utilisation <= 1
  if allocation == "max_len":
    assert engine.stats.max_running == 1  # 12 pages per request, 16 in the pool


def test_sampled_tokens_do_not_depend_on_batching(model_params):
  """A request's random key is fixed by its id and token index: the same tokens whether it is
  batched with others (and preempted) or runs by itself."""
  model, params = model_params
  requests = workload(seed=2, count=6)
  sampling = kvjax.Sampling.create(temperature=1.0, top_k=20)
  batched, engine = serve(model, params, requests, sampling=sampling)
  alone = Engine(model, params, CONFIG)
  for i, (prompt, n) in enumerate(requests):
    assert alone.submit(prompt, n, sampling) == i
    np.testing.assert_array_equal(alone.run()[i], batched[i])
  greedy = [greedy_alone(model, params, prompt, n) for prompt, n in requests]
  assert any(not np.array_equal(a, b) for a, b in zip(batched, greedy))


def test_eos_stops_a_request_and_frees_its_pages(model_params):
  model, params = model_params
  prompt, _ = workload(seed=3, count=1)[0]
  full = greedy_alone(model, params, prompt, 20)
  eos = int(full[5])
  stop = int(np.argmax(full == eos))
  config = EngineConfig(**{**vars(CONFIG), "stop_ids": (eos,)})
  (tokens,), _ = serve(model, params, [(prompt, 20)], config)
  np.testing.assert_array_equal(tokens, full[: stop + 1])


def test_a_cancelled_request_frees_its_pages_and_leaves_the_others_alone(model_params):
  model, params = model_params
  requests = workload(seed=5, count=6)
  want = [greedy_alone(model, params, prompt, n) for prompt, n in requests]
  engine = Engine(model, params, CONFIG)
  ids = [engine.submit(prompt, n) for prompt, n in requests]
  engine.step()
  running, waiting = engine.running[0].id, engine.waiting[-1].id
  assert engine.cancel(running) and engine.cancel(waiting)
  assert not engine.cancel(running) and not engine.cancel(12345)  # gone, or never there
  engine.allocator.check()
  out = engine.run()
  assert sorted(out) == [i for i in ids if i not in (running, waiting)]
  for i in out:
    np.testing.assert_array_equal(out[i], want[ids.index(i)])
  assert engine.allocator.num_free == engine.allocator.num_usable


@pytest.mark.parametrize("chunk", [1, 5])
def test_prompts_prefilled_in_chunks_between_decode_steps_change_no_token(model_params, chunk):
  """At most `chunk` context tokens per step: prompts of up to 20 tokens take several steps while
  the rows admitted earlier keep decoding, and a preempted request's context is recomputed in chunks."""
  model, params = model_params
  requests = workload(seed=0)
  want = [greedy_alone(model, params, prompt, n) for prompt, n in requests]
  out, engine = serve(model, params, requests, EngineConfig(**{**vars(CONFIG), "prefill_chunk": chunk}))
  for tokens, expected in zip(out, want):
    np.testing.assert_array_equal(tokens, expected)
  assert engine.stats.preemptions > 0
  assert engine.stats.mixed_steps > 0  # chunks ran in the decode rows' calls
  _, whole = serve(model, params, requests, EngineConfig(**{**vars(CONFIG), "prefill_chunk": 0}))
  assert engine.stats.decode_steps > whole.stats.decode_steps  # more steps: the prompts were spread over them


def test_a_cached_prefix_is_shared_and_changes_no_token(model_params):
  """Prompts opening with one 16-token document (4 pages), one of them exactly the document, one
  a whole number of pages, some preempted and recomputed: each request's tokens are its own alone,
  and the later requests read the document's pages instead of computing them."""
  model, params = model_params
  rng = np.random.default_rng(7)
  document = rng.integers(0, 64, 16, dtype=np.int32)
  tails = [rng.integers(0, 64, n, dtype=np.int32) for n in (0, 3, 8, 1, 5, 12)]
  requests = [(np.concatenate([document, tail]), 14) for tail in tails]
  want = [greedy_alone(model, params, prompt, n) for prompt, n in requests]
  out, engine = serve(model, params, requests)
  for tokens, expected in zip(out, want):
    np.testing.assert_array_equal(tokens, expected)
  assert engine.stats.cached_tokens >= 12 * 5  # every later request reads the document's first 3 pages or more
  assert engine.stats.preemptions > 0
  plain, off = serve(model, params, requests, EngineConfig(**{**vars(CONFIG), "prefix_caching": False}))
  assert off.stats.cached_tokens == 0 and all((a == b).all() for a, b in zip(plain, out))


def test_bad_requests_are_rejected_and_lose_nothing(model_params):
  model, params = model_params
  engine = Engine(model, params, CONFIG)
  engine.submit(np.array([1, 2, 3]), 4)
  with pytest.raises(ValueError, match="needs 50 cache positions, more than max_len=48"):
    engine.submit(np.arange(30) % 64, 21)
  with pytest.raises(ValueError, match="non-empty 1-D integer array"):
    engine.submit(np.array([], np.int32), 4)
  with pytest.raises(ValueError, match="token id 64 at position 1"):
    engine.submit(np.array([1, 64]), 4)
  with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
    engine.submit(np.array([1]), 0)
  with pytest.raises(ValueError, match="sampling must be a kvjax.Sampling"):
    engine.submit(np.array([1]), 2, sampling={"temperature": 1.0})
  small = Engine(model, params, EngineConfig(**{**vars(CONFIG), "num_pages": 5}))
  with pytest.raises(ValueError, match="needs up to 10 pages under allocation='paged' but the pool has 4"):
    small.submit(np.arange(20) % 64, 20)
  assert len(engine.waiting) == 1 and engine.allocator.num_free == engine.allocator.num_usable
  with pytest.raises(ValueError, match="EngineConfig.allocation must be one of"):
    EngineConfig(allocation="buddy")
  with pytest.raises(ValueError, match="EngineConfig.num_slots must be a positive integer"):
    EngineConfig(num_slots=0)
  with pytest.raises(ValueError, match="exceeds ModelConfig.max_len=64"):
    Engine(model, params, EngineConfig(max_len=65))
  with pytest.raises(ValueError, match="CacheConfig.paged_read must be one of"):
    EngineConfig(cache=CacheConfig(layout="paged", paged_read="flash"))
  with pytest.raises(ValueError, match=r"EngineConfig.cache must be a CacheConfig with layout='paged'"):
    EngineConfig(cache=CacheConfig(page_size=4))
  with pytest.raises(ValueError, match=r"EngineConfig.cache must be a CacheConfig .* got \{'layout': 'paged'\}"):
    EngineConfig(cache={"layout": "paged"})
  if not kvjax.cache.layouts.paged.pallas_available():
    with pytest.raises(ValueError, match="needs a GPU backend"):
      Engine(model, params, EngineConfig(cache=CacheConfig(layout="paged", paged_read="pallas")))
  # The engine's pool is its CacheConfig's: pages of page_size tokens in its codec.
  int8 = Engine(model, params, EngineConfig(**{**vars(CONFIG), "cache": CONFIG.cache.replace(dtype="int8")}))
  assert (int8.cache.page_size, int8.cache.num_pages, int8.cache.route) == (4, 17, ("paged", "int8"))


def test_warmup_compiles_every_call_a_workload_makes(model_params):
  """After warmup, serving (prefills, chunks after cached pages, mixed steps, decode steps at every
  width) compiles nothing more: the calls' shapes are bounded and warmup covers them."""
  model, params = model_params
  engine = Engine(model, params, CONFIG)
  engine.warmup()
  calls = (steps.prefill, steps.extend, steps.decode, steps.pick, mixed.step)
  compiled = [call._cache_size() for call in calls]
  for prompt, n in workload(seed=3, count=12):
    engine.submit(prompt, n)
  engine.run()
  assert engine.stats.mixed_steps > 0 and engine.stats.preemptions > 0
  assert [call._cache_size() for call in calls] == compiled
