"""`kvjax bench hf`: kvjax's generate against Hugging Face transformers' generate (static cache,
greedy), timed in alternating rounds, tokens compared (needs the `bench` extra: torch,
transformers).

Without --model both run the same random Llama-style weights of the benchmark model (saved by
transformers, imported by kvjax.interop). With --model NAME (a named model, a GGUF file or a
Hugging Face folder) both run that pretrained model on prompts of held-out prose
(kvjax.bench.peers.hf_model), at batch 1 and 8 unless --batch is given.
"""

from __future__ import annotations

import statistics
import tempfile

import numpy as np

from kvjax.bench.base.harness import BENCH_MODEL, BenchConfig, check_generation, random_prompts
from kvjax.bench.peers.hf_model import check_source, hf_greedy_kwargs, import_torch, load_both, prose_prompts
from kvjax.bench.base.registry import Benchmark, Kind, Option
from kvjax.config import ModelConfig
from kvjax.decoding import decode
from kvjax.kernels import attention as attention_kernel
from kvjax.kernels import matmul
from kvjax.model.transformer import Transformer
from kvjax.timing import timed_alternating


def bench_hf(
  cfg: ModelConfig = BENCH_MODEL,
  *,
  batch: int = 8,
  prompt: int = 128,
  new_tokens: int = 128,
  repeats: int = 5,
  threads: int = 0,
) -> dict:
  """kvjax's generate vs transformers' (static cache) on the same weights, in `repeats` alternating
  rounds; torch uses `threads` threads (0: torch's default)."""
  try:
    import torch
    import transformers
  except ImportError as err:
    raise ValueError(f"`kvjax bench hf` needs the bench extra (pip install 'kvjax[bench]'): {err}") from None
  from kvjax.interop.importer import from_hf

  torch.manual_seed(0)
  torch.set_num_threads(threads or torch.get_num_threads())
  hf_model = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      max_position_embeddings=cfg.max_len,
      rms_norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_theta,
      tie_word_embeddings=False,
      torch_dtype="float32",
    )
  ).eval()
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(tmp, safe_serialization=True)
    params, imported = from_hf(tmp)
  model = Transformer(imported)
  prompts, lengths = random_prompts(imported, batch, prompt)
  ours = np.asarray(decode.generate(model, params, prompts, lengths, new_tokens))

  input_ids = torch.from_numpy(prompts.astype(np.int64))
  generate_kwargs = hf_greedy_kwargs(torch, input_ids, new_tokens)
  with torch.inference_mode():
    theirs = hf_model.generate(input_ids, **generate_kwargs)[:, prompt:].numpy()
    times = timed_alternating(
      {
        "kvjax": lambda: decode.generate(model, params, prompts, lengths, new_tokens),
        "hf": lambda: hf_model.generate(input_ids, **generate_kwargs),
      },
      repeats,
    )
  kvjax_s, hf_s = statistics.median(times["kvjax"]), statistics.median(times["hf"])
  ratios = [h / k for k, h in zip(times["kvjax"], times["hf"])]
  tokens = batch * new_tokens
  return {
    "benchmark": "hf",
    "model": imported.to_dict(),
    "batch": batch,
    "prompt": prompt,
    "new_tokens": new_tokens,
    "torch_threads": torch.get_num_threads(),
    "small_matmul_kernel": matmul.uses_kernel(batch, imported.compute_dtype),
    "decode_attention_kernel": attention_kernel.uses_kernel(imported.compute_dtype, ("contiguous", imported.dtype)),
    "transformers_version": transformers.__version__,
    "torch_version": torch.__version__,
    "kvjax_tokens_per_s": tokens / kvjax_s,
    "hf_tokens_per_s": tokens / hf_s,
    "kvjax_over_hf": hf_s / kvjax_s,
    "kvjax_over_hf_per_round": ratios,
    "kvjax_s": times["kvjax"],
    "hf_s": times["hf"],
    "greedy_tokens_agree": float((ours == theirs).mean()),
  }


def bench_pretrained(
  source: str, *, batches=(1, 8), prompt: int = 128, new_tokens: int = 128, repeats: int = 3
) -> dict:
  """Greedy generation tokens/s of kvjax and transformers on the same model and prompts, at each
  batch size, timed in alternating rounds (median); tokens agreeing between the two reported."""
  torch, _ = import_torch()
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


def run(
  config: BenchConfig, *, model: str | None, batch: int | None, prompt: int, new: int, repeats: int, threads: int
) -> dict:
  if model is None:
    check_generation(config.model, prompt, new)
    return bench_hf(config.model, batch=batch or 8, prompt=prompt, new_tokens=new, repeats=repeats, threads=threads)
  if config != BenchConfig():
    raise ValueError("--set changes the benchmark model; with --model the pretrained model is used as it is")
  check_source(model)
  return bench_pretrained(model, batches=(batch,) if batch else (1, 8), prompt=prompt, new_tokens=new, repeats=repeats)


BENCHMARK = Benchmark(
  name="hf",
  summary="kvjax generate vs transformers' generate on the same weights (--model: a pretrained model)",
  run=run,
  options=(
    Option("model", None, "a pretrained model (e.g. smollm2-135m, a .gguf, a Hugging Face folder)", Kind.SOURCE),
    Option("batch", None, "sequences (rows) per step (default: 8; with --model: 1 and 8)"),
    Option("prompt", 128, "prompt tokens per sequence"),
    Option("new", 128, "new tokens per sequence"),
    Option("repeats", 5, "alternating timed rounds after a warm-up (median)"),
    Option("threads", 0, "torch threads, without --model (0: torch's default)", Kind.NONNEGATIVE),
  ),
  config=BenchConfig(),
  description=__doc__,
)
