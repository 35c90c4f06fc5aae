"""The pieces of `kvjax bench real` that decide what is measured: the chat workload (seeded, in
range, in the chat template) and the latency figures taken from token times."""

import numpy as np
import pytest

from kvjax.bench.engine_workload import Workload, agreement, latency_summary
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.training.checkpoint import load_model


def test_latency_summary():
  # Two requests arriving at 0 and 1 s; their tokens at the listed times; 4 s in all.
  out = latency_summary([0.0, 1.0], [[0.5, 1.0, 1.5], [3.0, 3.5]], 4.0, [3, 2])
  assert out["requests_per_s"] == 0.5 and out["tokens_per_s"] == 5 / 4
  assert out["ttft_p50_s"] == pytest.approx(1.25) and out["ttft_p99_s"] == pytest.approx(0.5 + 0.99 * 1.5)
  # Arrival to last token: 1.5 and 2.5 s.
  assert out["latency_p50_s"] == pytest.approx(2.0) and out["latency_p99_s"] == pytest.approx(1.5 + 0.99 * 1.0)
  assert out["per_token_p50_s"] == pytest.approx(0.5) and out["per_token_p99_s"] == pytest.approx(0.5)


def test_agreement_counts_equal_answers_and_common_prefixes():
  out = agreement([[1, 2, 3, 4], [5, 6], [7, 8]], [[1, 2, 9, 4], [5, 6], [0, 8]])
  assert out["requests"] == 3 and out["equal_answers"] == pytest.approx(1 / 3)
  assert out["mean_prefix_fraction"] == pytest.approx((2 / 4 + 1 + 0) / 3)


def test_workload_is_seeded_chat_in_range(smollm2):
  model, _, _ = load_model(smollm2)
  tokenizer = TextTokenizer.load(smollm2, model.config.vocab_size)
  workload = Workload(requests=6, prompt_tokens=(32, 96), new_tokens=(8, 16), seed=3)
  requests = workload.build(tokenizer)
  assert requests == workload.build(tokenizer)  # the same requests every run
  arrivals = [r[0] for r in requests]
  assert arrivals == sorted(arrivals) and arrivals[0] > 0
  start = [int(t) for t in tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))[:2]]
  for _, prompt, new in requests:
    assert 8 <= new <= 16 and len(prompt) <= 96 and prompt[:2] == start
    assert np.asarray(prompt).max() < model.config.vocab_size
