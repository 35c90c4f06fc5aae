"""`kvjax bench load`: the load test finds nothing lost on a small load (every answer generate's,
every page back, every cancel applied, exactly the oversize requests refused) and at its full
1,000 requests in the second tier; a random-weight model with SmolLM2's tokenizer keeps it fast."""

from __future__ import annotations

import pytest

from kvjax.bench.serving.load import Load, load_test
from kvjax.interop.tokenizer import TextTokenizer
from conftest import init_params, tiny_config

pytest.importorskip("openai")


def served_load(smollm2, load: Load) -> dict:
  tokenizer = TextTokenizer.load(smollm2)
  model, params = init_params(tiny_config(2, vocab_size=tokenizer.vocab_size, max_len=load.max_len))
  return load_test(model, params, tokenizer, load)


def check(out: dict, load: Load) -> None:
  assert all(v is True for v in out["checks"].values()), out["checks"]
  assert out["finished"] + out["cancelled"] + out["refused"] == load.requests
  assert out["cancelled"] > 0 and out["refused"] > 0
  # Preemptions depend on how the clients' requests happen to overlap in time (a busy machine's
  # clients keep fewer rows running): reported, not required here; tests/serving/test_engine.py
  # preempts deterministically and checks the recomputed answers.
  assert out["fewest_free_pages"] < 8  # the pool ran out: requests waited for pages


@pytest.mark.tier2  # the server's own oracles (tests/serving/test_server.py) are in the first tier
def test_a_small_load_loses_nothing(smollm2):
  # 12 pages: two of the longest requests (8 pages) cannot run at once; an oversize one needs 16.
  load = Load(
    requests=48,
    clients=8,
    distinct=4,
    prompt_tokens=(16, 96),
    new_tokens=(1, 24),
    oversize=0.08,
    cancel=0.2,
    max_len=256,
    pool_tokens=192,
  )
  check(served_load(smollm2, load), load)


@pytest.mark.tier2
def test_a_thousand_requests_lose_nothing(smollm2):
  # 64 pages for 8 rows of up to 19: the pool runs out even when the clients keep few rows running.
  load = Load(pool_tokens=1024)
  check(served_load(smollm2, load), load)
