"""`kvjax bench prefix`: requests over one shared document compute the document once with the
prefix cache (later prefills compute only their question) and give the answers made without it."""

from __future__ import annotations

import pytest

from kvjax.bench.serving.prefix import first_tokens, prompts
from kvjax.cache.config import CacheConfig
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.serving.engine import Engine, EngineConfig
from conftest import init_params, tiny_config


@pytest.mark.tier2  # the engine's prefix-caching oracle is tests/serving/test_engine.py's, in the first tier
def test_later_requests_compute_only_their_question(smollm2):
  tokenizer = TextTokenizer.load(smollm2)
  asks = prompts(tokenizer, 96, 3)
  model, params = init_params(tiny_config(2, vocab_size=tokenizer.vocab_size, max_len=256))
  sides = {}
  for caching in (True, False):
    config = EngineConfig(
      num_slots=1,
      num_pages=33,
      max_len=256,
      cache=CacheConfig(layout="paged", page_size=16),
      prefix_caching=caching,
      prefill_chunk=32,  # the document over several steps: the first token is timed at its end
    )
    sides[caching] = first_tokens(Engine(model, params, config), asks, 6)
  on, off = sides[True], sides[False]
  assert on["answers"] == off["answers"] and all(len(a) == 6 for a in on["answers"])
  assert off["computed_tokens"] == [a.size for a in asks] == [on["computed_tokens"][0], *[a.size for a in asks[1:]]]
  shared = min(a.size for a in asks) - 30  # the chat template's opening and the document, at least
  assert all(c < a.size - shared for c, a in zip(on["computed_tokens"][1:], asks[1:]))
