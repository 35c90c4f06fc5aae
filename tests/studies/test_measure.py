"""The measurement layer against oracles: bytes by hand and by the arrays a prefill allocates,
negative log-likelihood through a cache against a plain forward pass, the two recall protocols
against each other, recall's records, and the Pareto front on hand-made rows."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from kvjax.cache.config import CacheConfig
from kvjax.decoding import decode
from kvjax.studies.base import measure
from kvjax.studies.base.variants import cache, pareto
from conftest import init_params, tiny_config

CONTEXT = 64


@pytest.fixture(scope="module")
def tiny():
  """A random model of 2 layers, 2 kv heads of 8 dims, 64 positions, and 2 windows of 64 tokens."""
  model, params = init_params(tiny_config(max_len=CONTEXT))
  tokens = np.random.default_rng(0).integers(0, 64, (2, CONTEXT + 1)).astype(np.int32)
  return model, params, [(tokens[:, :-1], tokens[:, 1:])]


def test_kv_bytes_per_token_by_hand_and_as_allocated(tiny):
  model, params, _ = tiny
  # 2 layers x (K + V) x 2 kv heads x 8 dims x 4 bytes, and the row's int32 length over 64 tokens.
  assert measure.kv_bytes_per_token(model.config, cache(), CONTEXT) == (256 * 64 + 4) / 64
  # int8: each 8-dim vector is 8 bytes and a float32 scale.
  assert measure.kv_bytes_per_token(model.config, cache("int8"), CONTEXT) == (2 * 2 * 2 * 12 * 64 + 4) / 64
  # A window of 16 keeps 16 positions of every layer.
  assert measure.kv_bytes_per_token(model.config, cache(window=16), CONTEXT) == (256 * 16 + 4) / 64
  # Knorm at 0.5 keeps 32 of the prompt's 64 slots, each with an int32 position and a float32
  # score per kv head and layer beside K and V.
  knorm = cache(press="knorm", ratio=0.5)
  assert measure.kv_bytes_per_token(model.config, knorm, CONTEXT) == ((256 + 2 * 2 * 8) * 32 + 4) / 64
  # The same as what a prefill of a 64-token prompt allocates (the layers' arrays and the lengths).
  prompt = np.zeros((1, CONTEXT), np.int32)
  for config in (cache(), cache("int8"), cache(window=16), knorm):
    _, filled = decode.prefill(model, params, prompt, np.array([CONTEXT]), CONTEXT, cache_config=config)
    assert measure.kv_bytes_per_token(model.config, config, CONTEXT) == (filled.nbytes + 4) / CONTEXT


def plain_nll(model, params, windows, start: int) -> tuple[float, int]:
  """The oracle: a causal forward pass over each whole window, its predictions from `start` scored."""
  total = count = 0
  for inputs, targets in windows:
    nll = -jax.nn.log_softmax(model.apply({"params": params}, inputs), axis=-1)[:, start:]
    total += float(np.take_along_axis(np.asarray(nll), targets[:, start:, None].astype(np.int64), axis=-1).sum())
    count += targets[:, start:].size
  return total, count


def test_nll_through_a_float32_cache_is_the_forward_pass(tiny):
  model, params, windows = tiny
  half = plain_nll(model, params, windows, CONTEXT // 2)
  extended = measure.nll(model, params, windows, cache(), CONTEXT // 2)
  assert extended[1] == half[1] == 2 * 32
  assert extended[0] == pytest.approx(half[0], rel=1e-5)
  stepwise = measure.nll(model, params, windows, cache(), CONTEXT // 2, stepwise=True)
  assert stepwise[1] == half[1] and stepwise[0] == pytest.approx(half[0], rel=1e-5)
  everything = plain_nll(model, params, windows, 0)
  for context, stepwise in ((CONTEXT, False), (1, True)):
    got = measure.nll(model, params, windows, cache(), context, score_context=True, stepwise=stepwise)
    assert got[1] == everything[1] == 2 * CONTEXT and got[0] == pytest.approx(everything[0], rel=1e-5)
  assert measure.perplexity(model, params, windows, cache(), CONTEXT // 2) == pytest.approx(
    math.exp(half[0] / half[1]), rel=1e-5
  )
  # A window of 8 forgets what the scored tokens would read: another number.
  assert measure.nll(model, params, windows, cache(window=8), CONTEXT // 2)[0] != pytest.approx(half[0], rel=1e-5)
  with pytest.raises(ValueError, match=r"context=0 must be in \[1, 64\]"):
    measure.nll(model, params, windows, cache(), 0)


def test_both_protocols_answer_alike_through_a_full_cache(tiny):
  model, params, _ = tiny
  rng = np.random.default_rng(1)
  prompts = rng.integers(1, 64, (3, 20)).astype(np.int32)
  lengths = np.array([20, 14, 17], np.int32)
  question = np.array([5, 6, 7], np.int32)
  asked = np.zeros((3, 23), np.int32)
  for i, n in enumerate(lengths):
    asked[i, : n + 3] = np.concatenate([prompts[i, :n], question])
  # Oracle: prefill, then read the question, then decode == generate from the whole prompt.
  whole = measure.answers(model, params, asked, lengths + 3, 6)
  after = measure.answers(model, params, prompts, lengths, 6, question=question)
  paged = measure.answers(model, params, asked, lengths + 3, 6, CacheConfig(layout="paged", page_size=8))
  assert [a.tolist() for a in after] == [a.tolist() for a in whole] == [a.tolist() for a in paged]
  assert all(len(a) == 6 for a in whole)
  # A stop id cuts every answer before it.
  stop = int(whole[0][2])
  cut = measure.answers(model, params, asked, lengths + 3, 6, stop_ids=(stop,), question=None)
  first = whole[0].tolist().index(stop)
  assert cut[0].tolist() == whole[0][:first].tolist() and all(stop not in a.tolist() for a in cut)


def test_recall_keeps_a_record_per_sample_in_order(tiny):
  model, params, _ = tiny
  prompts = np.ones((5, 8), np.int32)
  expected = [True, False, True, True, False]
  exact, records = measure.recall(
    model,
    params,
    prompts,
    np.full(5, 8, np.int32),
    expected,
    lambda answer, want: {"hit": want, "tokens": len(answer)},
    3,
    batch_size=2,
  )
  assert exact == 3 / 5
  assert records == [{"index": i, "hit": want, "tokens": 3} for i, want in enumerate(expected)]


def test_decode_step_times_every_repeat(tiny):
  model, params, _ = tiny
  for config in (cache(), cache(press="knorm", ratio=0.5)):
    times = measure.decode_step_ms(model, params, config, batch=2, context=16, repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_pareto_on_hand_made_rows():
  rows = [{"x": 1, "y": 5}, {"x": 2, "y": 3}, {"x": 3, "y": 4}, {"x": 4, "y": 1}, {"x": 2, "y": 3}]
  # Lower y is better: (3, 4) is beaten by (2, 3); the two equal rows beat neither.
  assert pareto(rows, "x", "y") == [True, True, False, True, True]
  # Higher y is better: (1, 5) beats every other row.
  assert pareto(rows, "x", "y", lower=False) == [True, False, False, False, False]
  assert pareto([{"x": 1, "y": 1}], "x", "y") == [True]


def test_the_protocols_split_one_way():
  contexts, questions = [[5, 6, 7], [8]], [[1, 2], [3]]
  prompts, lengths, asked = measure.protocol_inputs("query_aware", contexts, questions)
  assert prompts.tolist() == [[5, 6, 7, 1, 2], [8, 3, 0, 0, 0]] and lengths.tolist() == [5, 2] and asked == {}
  prompts, lengths, asked = measure.protocol_inputs("query_agnostic", contexts, questions)
  assert prompts.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1]
  assert asked["question"].tolist() == [[1, 2], [3, 0]] and asked["question_lengths"].tolist() == [2, 1]
  with pytest.raises(ValueError, match="protocol must be one of"):
    measure.protocol_inputs("query_first", contexts, questions)
