"""The engine with a press (kvjax.cache.layouts.paged_evict): every request gets the tokens `generate`
gives it alone with the same press, and holds only the pages its kept tokens need."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvjax
from kvjax.cache import selection
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.paged_evict import PagedEvictCache
from kvjax.cache.presses import PRESSES as REGISTERED, KNorm, SnapKV, StreamingLLM, make_press
from kvjax.serving.engine import Engine, EngineConfig
from conftest import init_params, tiny_config

MAX_LEN = 48
PAGE = 4
PRESSES = {
  "snapkv": SnapKV(compression_ratio=0.75, window=4),
  "streaming_llm": StreamingLLM(compression_ratio=0.75, sinks=2),
  "knorm": KNorm(compression_ratio=0.75),
}


def pressed(press, **changes) -> EngineConfig:
  """4 rows over 12 usable pages of 4 slots: the requests below cannot all run at once."""
  cache = CacheConfig(layout="paged_evict", page_size=PAGE, press=press)
  return EngineConfig(**{**dict(num_slots=4, num_pages=13, max_len=MAX_LEN, cache=cache), **changes})


@pytest.fixture(scope="module")
def model_params():
  return init_params(tiny_config(2))


def workload(seed: int, count: int = 7):
  rng = np.random.default_rng(seed)
  requests = []
  for _ in range(count):
    prompt = rng.integers(0, 64, int(rng.integers(12, 31)), dtype=np.int32)
    requests.append((prompt, int(rng.integers(4, 17))))
  return requests


def generate_each(model, params, requests, press):
  """`generate` through the evicting layout, greedy: every request's tokens, its ragged prompt a
  row of one batch (each row is pressed by its own length)."""
  prompts = np.zeros((len(requests), max(p.size for p, _ in requests)), np.int32)
  for row, (prompt, _) in enumerate(requests):
    prompts[row, : prompt.size] = prompt
  lengths = np.array([p.size for p, _ in requests])
  longest = max(n for _, n in requests)
  out = np.asarray(kvjax.generate(model, params, prompts, lengths, longest, cache_config=CacheConfig(press=press)))
  return [out[row, :n] for row, (_, n) in enumerate(requests)]


def serve(model, params, requests, config):
  engine = Engine(model, params, config)
  ids = [engine.submit(prompt, n) for prompt, n in requests]
  outputs = engine.run()
  engine.allocator.check()
  assert engine.allocator.num_free == engine.allocator.num_usable  # every page came back
  return [outputs[i] for i in ids], engine


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm"])
def test_engine_with_a_press_is_generate_with_the_press(model_params, name):
  model, params = model_params
  press = PRESSES[name]
  requests = workload(seed=0)
  got, engine = serve(model, params, requests, pressed(press))
  assert engine.stats.preemptions > 0  # recompute (press the prompt, append the generated) is exercised
  assert engine.stats.max_running > 1
  for tokens, want in zip(got, generate_each(model, params, requests, press)):
    np.testing.assert_array_equal(tokens, want)


SMALL = {
  "snapkv": {"window": 4},
  "streaming_llm": {"sinks": 2},
  "expected_attention": {"n_future_positions": 8},
  "kvzip": {"sinks": 2, "chunk_size": 16, "repeat_ids": (5, 6, 7), "resume_ids": (8, 9), "suffix_ids": (10, 11)},
}
BUDGETS = {  # a budget composes with any scorer: each over SnapKV's
  "adaptive": {"heads": "adaptive"},
  "pyramid": {"layers": "pyramid"},
  "decode_budget": {"decode_budget": 8},
  "prefill_chunk": {"decode_budget": 8, "prefill_chunk": 8},
}
# What the engine's pages cannot hold (kvjax.cache.selection.refusal), by the field it names.
REFUSED = {"kvzip": "model_level", "adaptive": "heads", "pyramid": "layers", "prefill_chunk": "prefill_chunk"}
REFUSED["chunkkv"] = "grouped"


def every_press() -> dict:
  """Every registered press at ratio 0.5, and every budget over SnapKV."""
  out = {name: make_press(name, compression_ratio=0.5, **SMALL.get(name, {})) for name in REGISTERED}
  for budget, fields in BUDGETS.items():
    out[budget] = make_press("snapkv", compression_ratio=0.5, **SMALL["snapkv"], **fields)
  return out


# The presses whose scores read the most (values and RoPE, attention, key geometry) run in the
# first tier; the rest of the registry in the second.
FIRST_TIER = set(REFUSED) | {"expected_attention", "observed", "keydiff", "decode_budget"}


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=() if n in FIRST_TIER else pytest.mark.tier2) for n in sorted(every_press())]
)
def test_the_engine_serves_every_press_and_budget_as_generate_or_refuses_it_by_name(model_params, name):
  """Three ragged requests at once: the engine's tokens are generate's with the same press, or
  the engine refuses the press naming the field its pages cannot hold."""
  model, params = model_params
  press = every_press()[name]
  if name in REFUSED:
    with pytest.raises(ValueError, match=rf"CacheConfig.press=.*\({REFUSED[name]}\): layout='paged_evict' cannot"):
      Engine(model, params, pressed(press))
    return
  requests = workload(seed=3, count=3)
  got, _ = serve(model, params, requests, pressed(press, num_pages=40))
  for tokens, want in zip(got, generate_each(model, params, requests, press)):
    np.testing.assert_array_equal(tokens, want)


BUDGETED = {  # (press, decode budget, interval, pages): one-token reads on the paged decode route, and with holes
  "knorm": (KNorm(compression_ratio=0.5), 8, 1, 9),
  "snapkv_interval_3": (SnapKV(compression_ratio=0.5, window=4), 8, 3, 9),
  # Its held scores read each call's attention: a preempted request's tokens recomputed in one call
  # would be pressed otherwise than when it decoded them (these pages make it matter).
  "tova": (make_press("tova", compression_ratio=0.5), 5, 4, 8),
  "knorm_interval_9": (KNorm(compression_ratio=0.5), 6, 9, 13),  # past DROP_PASSES: a sort
}


# The paged decode kernel's route and the attention-read scores in the first tier; holes and the sort in the second.
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=() if n in ("knorm", "tova") else pytest.mark.tier2) for n in sorted(BUDGETED)]
)
def test_a_decode_budget_bounds_every_request_and_keeps_generates_tokens(model_params, name):
  """Under a decode budget every request holds at most budget + interval slots while it decodes
  (pressed back as generate presses it), preempted ones too, and gets generate's tokens."""
  model, params = model_params
  scorer, budget, interval, pages = BUDGETED[name]
  press = dataclasses.replace(scorer, decode_budget=budget, decode_interval=interval)
  requests = workload(seed=4, count=10)  # generations of 4-16 tokens over budgets of 7-8: many pressings
  engine = Engine(model, params, pressed(press, num_pages=pages))  # rows of 3 pages at most
  ids = [engine.submit(prompt, n) for prompt, n in requests]
  most = 0
  while engine.waiting or engine.running:
    engine.step()
    for r in engine.running:
      most = max(most, engine.allocator.length(r.id))
      assert len(engine.allocator.pages(r.id)) <= -(-(budget + interval) // PAGE)
  assert most == budget + interval and engine.stats.preemptions > 0
  engine.allocator.check()
  assert engine.allocator.num_free == engine.allocator.num_usable
  for i, want in zip(ids, generate_each(model, params, requests, press)):
    np.testing.assert_array_equal(engine.finished[i].generated, want)


def test_a_request_holds_the_pages_of_its_kept_tokens(model_params):
  model, params = model_params
  press = PRESSES["snapkv"]
  engine = Engine(model, params, pressed(press, num_pages=40))
  requests = workload(seed=1, count=4)
  for prompt, n in requests:
    engine.submit(prompt, n)
  steps = 0
  while engine.waiting or engine.running:
    engine.step()
    steps += 1
    for r in engine.running:
      # After a step the cache holds the kept prompt and every generated token but the newest.
      held = int(selection.kept(r.prompt.size, press.compression_ratio)) + len(r.generated) - 1
      assert engine.allocator.length(r.id) == held
      assert len(engine.allocator.pages(r.id)) == -(-held // PAGE)
  assert steps > 1 and engine.stats.preemptions == 0


def test_ratio_zero_is_the_engine_without_a_press(model_params):
  model, params = model_params
  requests = workload(seed=2, count=4)
  plain_config = EngineConfig(
    num_slots=4, num_pages=13, max_len=MAX_LEN, cache=CacheConfig(layout="paged", page_size=PAGE)
  )
  plain, plain_engine = serve(model, params, requests, plain_config)
  zero, zero_engine = serve(model, params, requests, pressed(SnapKV(compression_ratio=0.0, window=4)))
  for a, b in zip(plain, zero):
    np.testing.assert_array_equal(a, b)
  assert zero_engine.stats.allocated_total == plain_engine.stats.allocated_total


def test_a_pressed_pool_runs_more_long_prompts_at_once(model_params):
  """Prompts of 28 tokens in 24 usable pages: unpressed, 8 pages each with the next token's;
  at ratio 0.75, 7 kept tokens in 2 pages, 3 pages as they generate."""
  model, params = model_params
  requests = [(np.arange(28, dtype=np.int32) + i, 4) for i in range(8)]  # distinct: no prefix to share
  counts = {}
  for press in (None, PRESSES["knorm"]):
    cache = CacheConfig(layout="paged" if press is None else "paged_evict", page_size=PAGE, press=press)
    _, engine = serve(model, params, requests, EngineConfig(num_slots=8, num_pages=25, max_len=MAX_LEN, cache=cache))
    counts[press] = engine.stats.max_running
  assert counts[None] == 3 and counts[PRESSES["knorm"]] == 8


def test_combinations_that_cannot_work_are_refused(model_params):
  model, params = model_params
  windowed = init_params(tiny_config(2, window=(8, 0)))
  with pytest.raises(ValueError, match=r"\(window\): layout='paged_evict' cannot hold it: the model's window=\(8, 0\)"):
    Engine(*windowed, pressed(PRESSES["knorm"]))
  with pytest.raises(ValueError, match="EngineConfig.allocation='doubling' reserves positions ahead"):
    pressed(PRESSES["knorm"], allocation="doubling")
  with pytest.raises(ValueError, match="layout='paged_evict' is the engine's"):
    kvjax.generate(
      model, params, np.ones((1, 8), np.int32), np.array([8]), 2, cache_config=pressed(PRESSES["knorm"]).cache
    )
  with pytest.raises(ValueError, match="CacheConfig.layout='paged_evict' needs a press"):
    CacheConfig(layout="paged_evict")
  with pytest.raises(ValueError, match=r"EngineConfig.cache must be a CacheConfig with layout='paged'"):
    EngineConfig(cache=CacheConfig(press=PRESSES["knorm"]))
  cache = PagedEvictCache.create(model.config, 5, PAGE, 1, 4, pressed(PRESSES["knorm"]).cache)
  with pytest.raises(ValueError, match="row 0 needs 3 slots, 1 pages of 4, but its page table holds 0"):
    cache.with_rows(np.zeros((1, 4)), np.array([10]), np.array([2])).check_room(np.array([1]))


def test_a_forked_pressed_prompt_decodes_as_the_evicting_layout(model_params):
  """Two sequences share a pressed prompt's pages (PageAllocator.fork); the first token each
  writes copies the shared page (copy on write) and each reads what the evicting layout reads."""
  model, params = model_params
  press = PRESSES["snapkv"]
  prompt = (np.arange(14, dtype=np.int32) * 5) % 64
  held = int(selection.kept(prompt.size, press.compression_ratio))  # 3 slots: one page, shared and not full
  alloc = kvjax.PageAllocator(num_pages=9, page_size=PAGE)
  alloc.allocate("a", held)
  cache = PagedEvictCache.create(model.config, 9, PAGE, 1, 4, pressed(press).cache)
  cache = cache.with_rows(alloc.page_table(["a"], 4), np.zeros(1), np.zeros(1))
  logits, cache = kvjax.extend(model, params, cache, prompt[None], np.array([prompt.size]), logits="last")
  want, _ = kvjax.prefill(
    model, params, prompt[None], np.array([prompt.size]), 16, cache_config=CacheConfig(press=press)
  )
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(want[0, -1]), atol=1e-5)
  alloc.fork("a", "b")
  for seq, token in (("a", 7), ("b", 9)):
    copies = alloc.append(seq, 1)
    assert len(copies) == (1 if seq == "a" else 0)  # "a" copies the shared page; "b" then owns it alone
    if copies:
      cache = cache.copy_pages(*zip(*copies))
    cache = cache.with_rows(alloc.page_table([seq], 4), np.array([prompt.size]), np.array([held]))
    logits, cache = kvjax.decode_step(model, params, cache, np.array([token]))
    _, reference = kvjax.prefill(
      model, params, prompt[None], np.array([prompt.size]), 16, cache_config=CacheConfig(press=press)
    )
    expected, _ = kvjax.decode_step(model, params, reference, np.array([token]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)
  assert alloc.pages("a") != alloc.pages("b")
