"""Decoding benchmarks (`kvjax bench`), each returning a JSON-ready dict. Every ratio is measured
in one run.

  decode   generate tokens/s and the decode step against this machine's rooflines, measured in
           the same run: memory bandwidth (a jitted reduction over 1 GiB) and matmul FLOP/s.
  nocache  the preallocated cache vs no cache, the concat cache and the doubling buffer.
  hf       kvjax generate vs Hugging Face transformers' generate (static cache) on the same
           Llama-style weights (needs the `bench` extra: torch, transformers).
  paged    paged vs contiguous decode step at equal batch and context.
  matmul   kvjax's CPU small-matmul kernel vs XLA's dot on the decode step's weight shapes.
  quant    one decode step's attention over an int8 cache vs a float32 cache (kvjax.bench.quant).
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.real_model import hf_greedy_kwargs
from kvjax.cache import kinds
from kvjax.cache.base import KVCache
from kvjax.cache.config import CacheConfig
from kvjax.fields import to_dict
from kvjax.config import ModelConfig
from kvjax.decoding import baselines, decode
from kvjax.kernels import attention as attention_kernel
from kvjax.kernels import matmul
from kvjax.model.flops import matmul_params, peak_flops
from kvjax.model.transformer import Transformer
from kvjax.cache.fill import filled
from kvjax.timing import timed, timed_alternating

# The Llama-style reference config of the benchmarks.
BENCH_MODEL = ModelConfig(
  vocab_size=4096, d_model=512, num_layers=8, num_heads=8, num_kv_heads=2, mlp_dim=1408, max_len=2048
)


def memory_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
  """Bytes/s that a jitted reduction streams from memory: the decode-step ceiling."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return num_bytes / timed(lambda: total(x), repeats)


def weight_bytes(cfg: ModelConfig) -> int:
  """Bytes of the weights one decode step reads (embedding rows gathered are negligible)."""
  return matmul_params(cfg) * 4


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, cache_config: CacheConfig = CacheConfig()) -> int:
  """Bytes one decode step at `context` positions per row reads: the weights and each row's
  cache (values and scales, a windowed layer's window and sinks only: kinds.sequence_bytes)."""
  return weight_bytes(cfg) + batch * kinds.sequence_bytes(cfg, cache_config, context)


def prefill_flops(cfg: ModelConfig, batch: int, prompt: int) -> float:
  attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt * prompt  # causal half of 4
  return batch * (2 * matmul_params(cfg) * prompt + attention)


def init_model(cfg: ModelConfig, seed: int = 0):
  model = Transformer(cfg)
  params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
  return model, params


STEP_REPEATS = 10  # timed decode steps per `time_decode_step`


def alternate_decode_steps(models: dict, caches: dict, batch: int, steps: int) -> tuple[dict, dict]:
  """Times decode steps of {name: (model, params)} over {name: cache} round-robin, `steps` rounds,
  each feeding token 0 to every row -> ({name: [seconds per step]}, {name: first step's logits})."""
  tokens = np.zeros((batch,), np.int32)
  first = {}

  def stepper(name):
    model, params = models[name]

    def step():
      logits, caches[name] = decode.decode_step(model, params, caches[name], tokens)
      first.setdefault(name, logits)
      return logits

    return step

  return timed_alternating({name: stepper(name) for name in caches}, steps), first


def filled_cache(
  model: Transformer, params, batch: int, context: int, max_len: int, cache_config: CacheConfig = CacheConfig()
) -> KVCache:
  """A cache of `cache_config` of max_len positions whose rows hold `context` random positions."""
  return filled(kinds.create(model.config, cache_config, batch, max_len), model.config, context)


def time_decode_step(model, params, cache, steps: int = STEP_REPEATS) -> float:
  """Median seconds of one `decode_step`, the cache donated from step to step. Runs steps + 1
  steps (one warm-up); a cache without room for them is refused before the first."""
  tokens = np.zeros((cache.lengths.shape[0],), np.int32)
  cache.check_room(np.full(tokens.shape, steps + 1))

  def step():
    nonlocal cache
    logits, cache = decode.decode_step(model, params, cache, tokens)
    return logits

  return timed(step, steps)


def random_prompts(cfg: ModelConfig, batch: int, prompt: int, seed: int = 0):
  tokens = np.asarray(jax.random.randint(jax.random.key(seed), (batch, prompt), 0, cfg.vocab_size), np.int32)
  return tokens, np.full((batch,), prompt, np.int32)


def bench_decode(
  cfg: ModelConfig = BENCH_MODEL,
  *,
  batch: int = 8,
  prompt: int = 128,
  new_tokens: int = 128,
  repeats: int = 5,
  cache_config: CacheConfig = CacheConfig(),
) -> dict:
  """Decode step (ms) on a cache of `cache_config` of `prompt` positions per row and, for
  new_tokens > 1, generate tokens/s from prompts of `prompt` tokens, each against its roofline;
  generate is timed as the median of `repeats` runs."""
  model, params = init_model(cfg)
  bandwidth, flops = memory_bandwidth(), peak_flops()[0]
  result = {
    "benchmark": "decode",
    "model": cfg.to_dict(),
    "batch": batch,
    "prompt": prompt,
    "new_tokens": new_tokens,
    "small_matmul_kernel": matmul.uses_kernel(batch, cfg.compute_dtype),
    "cache": to_dict(cache_config),
    "memory_bandwidth_GBps": bandwidth / 1e9,
    "matmul_GFLOPs": flops / 1e9,
  }

  cache = filled_cache(model, params, batch, prompt, prompt + STEP_REPEATS + 1, cache_config)
  result["decode_attention_kernel"] = attention_kernel.uses_kernel(cfg.compute_dtype, cache.route)
  step = time_decode_step(model, params, cache)
  step_bytes = decode_step_bytes(cfg, batch, prompt, cache_config)
  result.update(
    decode_step_ms=step * 1e3,
    decode_step_bytes=step_bytes,
    decode_step_roofline_ms=step_bytes / bandwidth * 1e3,
    decode_roofline_fraction=step_bytes / bandwidth / step,
  )

  if new_tokens > 1:
    prompts, lengths = random_prompts(cfg, batch, prompt)
    seconds = timed(
      lambda: decode.generate(model, params, prompts, lengths, new_tokens, cache_config=cache_config), repeats
    )
    ceiling = prefill_flops(cfg, batch, prompt) / flops + sum(
      decode_step_bytes(cfg, batch, prompt + i, cache_config) / bandwidth for i in range(new_tokens - 1)
    )
    tokens = batch * new_tokens
    result.update(
      generate_s=seconds,
      tokens_per_s=tokens / seconds,
      ceiling_tokens_per_s=tokens / ceiling,
      fraction_of_ceiling=ceiling / seconds,
    )
  return result


def bench_nocache(
  cfg: ModelConfig = BENCH_MODEL,
  *,
  prompt: int = 128,
  new_token_counts: Sequence[int] = (64, 128, 256, 512),
  concat_max: int = 64,
  repeats: int = 5,
) -> dict:
  """Seconds to generate each of `new_token_counts` new tokens from one prompt of `prompt` tokens
  with the preallocated cache and with the baselines; the concat cache, which compiles once per
  length, only up to concat_max new tokens."""
  model, params = init_model(cfg)
  prompts, lengths = random_prompts(cfg, 1, prompt)
  rows = []
  for new in new_token_counts:
    expected = np.asarray(decode.generate(model, params, prompts, lengths, new))
    row = {"new_tokens": new, "cached_s": timed(lambda: decode.generate(model, params, prompts, lengths, new), repeats)}
    strategies = {"nocache": baselines.generate_nocache, "doubling": baselines.generate_doubling}
    if new <= concat_max:
      strategies["concat"] = baselines.generate_concat
    for name, fn in strategies.items():
      tokens = fn(model, params, prompts, lengths, new)
      row[f"{name}_s"] = timed(lambda: fn(model, params, prompts, lengths, new), 1)
      row[f"{name}_over_cached"] = row[f"{name}_s"] / row["cached_s"]
      row[f"{name}_same_tokens"] = bool((tokens == expected).all())
    rows.append(row)
  return {"benchmark": "nocache", "model": cfg.to_dict(), "batch": 1, "prompt": prompt, "rows": rows}


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


def bench_matmul(cfg: ModelConfig = BENCH_MODEL, *, batch: int = 8, repeats: int = 5) -> dict:
  """Per-call time of x[rows, K] @ w[K, N] for each weight shape of a decode step and rows in
  (1, matmul.MIN_ROWS, batch, matmul.MAX_ROWS), by XLA's dot and by the kernel, in `repeats`
  alternating rounds. Each timed call chains 16 products over distinct weights
  (the weights stream from memory, as in a decode step)."""
  if not matmul.kernel_available():
    raise ValueError("the CPU small-matmul kernel is unavailable here (see kvjax.kernels.matmul)")
  d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  mlp_in = "gate, up" if cfg.activation == "swiglu" else "up"
  shapes = {"q": (d, q), "k, v": (d, kv), "out": (q, d), mlp_in: (d, cfg.mlp_dim), "down": (cfg.mlp_dim, d)}
  if not cfg.tie_embeddings:  # tied logits go through the embedding's attend, not a Dense layer
    shapes["lm_head"] = (d, cfg.vocab_size)
  chain = 16
  rng = np.random.default_rng(0)

  def chained(product, x, weights):
    def run(x, weights):
      for w in weights:  # each product feeds the next, so the calls cannot overlap
        x = x + 1e-3 * jnp.resize(product(x, w), x.shape)
      return x

    run = jax.jit(run)
    return lambda: run(x, weights)

  rows_list = sorted({1, matmul.MIN_ROWS, batch, matmul.MAX_ROWS})
  calls = {}
  for name, (k, n) in shapes.items():
    weights = [jnp.asarray(rng.standard_normal((k, n), np.float32)) for _ in range(chain)]
    for rows in rows_list:
      x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
      calls[name, rows, "xla"] = chained(jnp.matmul, x, weights)
      calls[name, rows, "kernel"] = chained(matmul.small_matmul, x, weights)
  times = timed_alternating(calls, repeats)
  results = []
  for name, (k, n) in shapes.items():
    for rows in rows_list:
      xla, kernel = (statistics.median(times[name, rows, side]) / chain for side in ("xla", "kernel"))
      results.append(
        {
          "weight": name,
          "rows": rows,
          "k": k,
          "n": n,
          "xla_us": xla * 1e6,
          "kernel_us": kernel * 1e6,
          "xla_over_kernel": xla / kernel,
          "kernel_weight_GBps": k * n * 4 / kernel / 1e9,
        }
      )
  return {"benchmark": "matmul", "model": cfg.to_dict(), "max_rows": matmul.MAX_ROWS, "results": results}
