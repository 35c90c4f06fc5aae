"""The pieces of `kvjax bench real` that decide what is measured: the chat workload (seeded, in
range, in the chat template), the latency figures taken from token times, the greedy agreement of
whole answers, and what transformers' int8 peer quantizes."""

import numpy as np
import pytest

from kvjax.bench.parts.engine_workload import Workload, latency_summary
from kvjax.bench.base.harness import greedy_agreement
from kvjax.bench.parts.real_formats import hf_formats
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


def test_agreement_counts_equal_answers_tokens_and_common_prefixes():
  """kvjax.bench.base.harness.greedy_agreement by hand, the one shape every benchmark reports: lists of
  any lengths (the engine's requests) and rows of arrays (a batch of answers)."""
  out = greedy_agreement([[1, 2, 3, 4], [5, 6], [7, 8], [1, 2]], [[1, 2, 9, 4], [5, 6], [0, 8], [1, 2, 3]])
  assert out == {
    "answers": 4,
    "equal_answers": 1 / 4,
    "equal_tokens": (3 + 2 + 1 + 2) / (4 + 2 + 2 + 3),  # equal positions over the longer answer of each pair
    "mean_prefix_fraction": pytest.approx((2 / 4 + 1 + 0 + 2 / 3) / 4),
    "first_divergence": [2, None, 0, 2],  # a shorter answer parts where it ends
  }
  rows = greedy_agreement(
    np.array([[5, 6, 7, 8], [1, 2, 0, 4], [0, 9, 9, 0]]), np.array([[5, 6, 7, 8], [1, 2, 3, 4], [9] * 4])
  )
  assert rows["equal_answers"] == 1 / 3 and rows["first_divergence"] == [None, 2, 0]
  with pytest.raises(ValueError, match="no answers"):
    greedy_agreement([], [])


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


def test_transformers_int8_quantizes_every_linear_and_keeps_the_embedding_float():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
  )
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).eval()
  models, notes = hf_formats(model)
  assert models["float32"] is model and models["bfloat16"].model.embed_tokens.weight.dtype == torch.bfloat16
  assert model.lm_head.weight.dtype == torch.float32  # the copies leave the float32 model as it was
  # 7 projections per layer (q, k, v, o, gate, up, down) and the lm_head, which is tied to the embedding.
  assert notes["quantized_linears"] == 2 * 7 + 1 and notes["lm_head_quantized"]
  assert notes["float32_parameters"] == {
    "model.embed_tokens.weight": 64 * 16,
    "model.layers.N.input_layernorm.weight": 2 * 16,
    "model.layers.N.post_attention_layernorm.weight": 2 * 16,
    "model.norm.weight": 16,
  }
