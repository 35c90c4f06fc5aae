"""The pieces of `kvjax bench real` that decide what is measured: the chat workload (seeded, in
range, in the chat template), the latency figures taken from token times, the greedy agreement of
whole answers, and what transformers' int8 peer quantizes."""

import numpy as np
import pytest

from kvjax.bench.engine_workload import Workload, latency_summary, request_agreement
from kvjax.bench.real_formats import agreement, hf_formats
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
  out = request_agreement([[1, 2, 3, 4], [5, 6], [7, 8]], [[1, 2, 9, 4], [5, 6], [0, 8]])
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


def test_agreement_is_whole_answers_prompt_by_prompt():
  reference = np.array([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
  answers = np.array([[5, 6, 7, 8], [1, 2, 0, 4], [0, 9, 9, 0]])
  # Prompt 1 differs at position 2 only, prompt 2 at 0 (and 3): one of three agrees whole.
  assert agreement(answers, reference) == {"prompts_agree": 1 / 3, "first_divergence": [None, 2, 0]}


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
