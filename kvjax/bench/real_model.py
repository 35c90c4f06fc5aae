"""A pretrained model in kvjax and in `transformers`, side by side (`kvjax bench hf --model NAME`,
`kvjax bench perplexity --model NAME`).

Both sides load the same file: kvjax through kvjax.interop.importer (a named model, a GGUF file or
a Hugging Face directory), `transformers` through its own loader of that file (its GGUF loader
for a .gguf, which dequantizes with the gguf library as kvjax does). Both compute in float32.

  decode      kvjax generate vs transformers generate (static cache), greedy, in alternating rounds
  perplexity  held-out loss per token on the same windows of English prose (kvjax.training.data's
              "prose" corpus, the model's own tokenizer): kvjax's plain forward pass vs transformers'
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from kvjax.decoding import decode
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.timing import timed_alternating
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset
from kvjax.training.evaluate import evaluate


def _torch():
  try:
    import torch
    import transformers
  except ImportError as err:
    raise ValueError(f"comparing with transformers needs the bench extra (pip install 'kvjax[bench]'): {err}") from None
  return torch, transformers


def hf_reference(path):
  """The transformers model (float32, eval mode) of the file kvjax imported from `path`."""
  torch, transformers = _torch()
  kwargs = {"gguf_file": path.name} if path.is_file() else {}
  folder = path.parent if path.is_file() else path
  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def hf_greedy_kwargs(torch, input_ids, new_tokens: int) -> dict:
  """transformers' generate arguments for exactly `new_tokens` greedy tokens per row of
  input_ids (no padding, no stop token), with its static cache: as kvjax's generate runs."""
  return dict(
    attention_mask=torch.ones_like(input_ids),
    max_new_tokens=new_tokens,
    min_new_tokens=new_tokens,
    do_sample=False,
    cache_implementation="static",
    pad_token_id=0,
    eos_token_id=None,
  )


def load_both(source: str):
  """(kvjax model, params, tokenizer, transformers model, versions) of one pretrained model."""
  torch, transformers = _torch()
  params, config, tokenizer, path = read_model(source)
  if tokenizer is None:
    raise ValueError(f"{source} has no tokenizer; the real-model benchmarks need one")
  versions = {
    "transformers_version": transformers.__version__,
    "torch_version": torch.__version__,
    "torch_threads": torch.get_num_threads(),
    "source": str(path),
  }
  return Transformer(config), params, tokenizer, hf_reference(path), versions


def prose_prompts(tokenizer, batch: int, prompt: int) -> np.ndarray:
  """int32 [batch, prompt]: windows of held-out prose, so decoding runs on text it could meet."""
  data = load_dataset(DataConfig(source=PROSE, seq_len=prompt), tokenizer)
  return next(eval_batches(data.val, prompt, batch, 1))[0]


def bench_decode(source: str, *, batches=(1, 8), prompt: int = 128, new_tokens: int = 128, repeats: int = 3) -> dict:
  """Greedy generation tokens/s of kvjax and transformers on the same model and prompts, at each
  batch size, timed in alternating rounds (median); tokens agreeing between the two reported."""
  torch, _ = _torch()
  model, params, tokenizer, hf_model, versions = load_both(source)
  rows = []
  for batch in batches:
    prompts = prose_prompts(tokenizer, batch, prompt)
    lengths = np.full((batch,), prompt, np.int32)
    ours = lambda: decode.generate(model, params, prompts, lengths, new_tokens)
    input_ids = torch.from_numpy(prompts.astype(np.int64))
    kwargs = hf_greedy_kwargs(torch, input_ids, new_tokens)
    with torch.inference_mode():
      theirs = lambda: hf_model.generate(input_ids, **kwargs)
      agree = float((np.asarray(ours()) == theirs()[:, prompt:].numpy()).mean())
      times = timed_alternating({"kvjax": ours, "hf": theirs}, repeats)
    kvjax_s, hf_s = statistics.median(times["kvjax"]), statistics.median(times["hf"])
    rows.append(
      {
        "batch": batch,
        "kvjax_tokens_per_s": batch * new_tokens / kvjax_s,
        "hf_tokens_per_s": batch * new_tokens / hf_s,
        "kvjax_over_hf": hf_s / kvjax_s,
        "kvjax_s": times["kvjax"],
        "hf_s": times["hf"],
        "greedy_tokens_agree": agree,
      }
    )
  return {
    "benchmark": "hf",
    "model": model.config.to_dict(),
    "prompt": prompt,
    "new_tokens": new_tokens,
    **versions,
    "rows": rows,
  }


def bench_perplexity(source: str, *, seq_len: int = 1024, batch: int = 4, batches: int = 3) -> dict:
  """Held-out prose perplexity of kvjax and transformers on the same batch x batches windows of
  seq_len tokens (kvjax.training.data.eval_batches); their relative difference."""
  torch, _ = _torch()
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
