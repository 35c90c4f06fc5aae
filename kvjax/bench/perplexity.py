"""`kvjax bench perplexity --model NAME`: held-out loss per token of a pretrained model in kvjax
(its plain forward pass) and in transformers, on the same windows of English prose
(kvjax.training.data's "prose" corpus, the model's own tokenizer), and their relative difference
(needs the `bench` extra: torch, transformers).
"""

from __future__ import annotations

import math

import numpy as np

from kvjax.bench.peers.hf_model import check_source, import_torch, load_both
from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Option
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset
from kvjax.training.evaluate import evaluate


def bench_perplexity(source: str, *, seq_len: int = 1024, batch: int = 4, batches: int = 3) -> dict:
  """Held-out prose perplexity of kvjax and transformers on the same batch x batches windows of
  seq_len tokens (kvjax.training.data.eval_batches); their relative difference."""
  torch, _ = import_torch()
  model, params, tokenizer, hf_model, versions = load_both(source)
  data = load_dataset(DataConfig(source=PROSE, seq_len=seq_len), tokenizer)
  ours = evaluate(model, params, data, batch_size=batch, num_batches=batches)
  total = 0.0
  with torch.inference_mode():
    for inputs, targets in eval_batches(data.val, seq_len, batch, batches):
      logits = hf_model(torch.from_numpy(inputs.astype(np.int64))).logits.float()
      total += float(
        torch.nn.functional.cross_entropy(
          logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets.astype(np.int64)).reshape(-1), reduction="sum"
        )
      )
  hf_loss = total / (batch * batches * seq_len)
  return {
    "benchmark": "perplexity",
    "corpus": PROSE,
    "seq_len": seq_len,
    "windows": batch * batches,
    **versions,
    "kvjax_loss": ours["loss"],
    "hf_loss": hf_loss,
    "kvjax_perplexity": ours["perplexity"],
    "hf_perplexity": math.exp(hf_loss),
    "relative_difference": ours["perplexity"] / math.exp(hf_loss) - 1,
    "bits_per_byte": ours["bits_per_byte"],
  }


def run(*, model: str, seq_len: int, batch: int, windows_batches: int) -> dict:
  check_source(model)
  return bench_perplexity(model, seq_len=seq_len, batch=batch, batches=windows_batches)


BENCHMARK = Benchmark(
  name="perplexity",
  summary="held-out prose perplexity of a pretrained model in kvjax vs transformers",
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("seq_len", 1024, "tokens per window"),
    Option("batch", 4, "windows per batch"),
    Option("windows_batches", 3, "batches of --batch windows"),
  ),
  description=__doc__,
)
