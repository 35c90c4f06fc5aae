"""One cell of `kvjax bench real_long`: one side runs whole greedy requests in this process.

kvjax: `decode.prefill` (last logits) into a cache of the cell's codec, then `decode.decode_step`
once per further token. `transformers`: its model in the same weight format (float32, bfloat16,
or int8: torch's dynamic int8 quantization of every Linear layer) with its static or dynamic
cache: one forward over the prompt (last logits), then one forward per further token, as its
`generate` runs them. Both pick each token by argmax on the host, so both phases end on a token
in hand: prefill = the prompt to the first token, decode = the other new_tokens - 1 tokens.

Each side warms up first (kvjax at the cell's shape, which compiles its functions; transformers
on a 16-token prompt: it compiles nothing), then runs the timed request. `peak_gib` is the
process's peak resident memory (VmHWM) over its life, loading included; `request_peak_gib` only
since the timed request began (the loaded model is resident in both). `kv_bytes` is the cache's
storage after the request: what each side allocated, not what the tokens need.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

import jax.numpy as jnp
import numpy as np

from kvjax.bench.peers.hf_model import peak_memory_gib, reset_peak_memory
from kvjax.bench.peers.hf_model import hf_reference, import_torch
from kvjax.cache.config import CacheConfig
from kvjax.decoding import decode
from kvjax.interop.gguf_file import GGUFFile, is_gguf
from kvjax.interop.importer import read_config, read_model, resolve_source
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.model.weights import store

SIDES = ("kvjax", "hf")
HF_CACHES = ("static", "dynamic")
WARMUP_PROMPT = 16


@dataclasses.dataclass(frozen=True)
class Cell:
  """One request shape on one side. cache: a kvjax cache codec (kvjax.cache.codec.NAMES) or a
  transformers cache (HF_CACHES); weights: a weight format (kvjax.model.weights.FORMATS)."""

  side: str
  cache: str
  weights: str
  batch: int
  prompt: int
  new_tokens: int

  @property
  def name(self) -> str:
    return f"{self.side}_{self.weights}_{self.cache}_{self.batch}x{self.prompt}+{self.new_tokens}"

  def same_shape(self, other: Cell) -> bool:
    return (self.batch, self.prompt, self.new_tokens) == (other.batch, other.prompt, other.new_tokens)


def read_tokenizer(path: pathlib.Path) -> TextTokenizer:
  """The tokenizer of a GGUF file or Hugging Face folder, without reading its weights."""
  if path.is_file() and is_gguf(path):
    return TextTokenizer.from_gguf_metadata(GGUFFile(path).metadata, source=str(path))
  tokenizer = TextTokenizer.load(path, read_config(path).vocab_size)
  if tokenizer is None:
    raise ValueError(f"{path} has no tokenizer; the real-model benchmarks need one")
  return tokenizer


def kvjax_side(source: str, cell: Cell):
  """run(prompts int32[B, P], new_tokens) -> (prefill s, decode s, ids int32[B, N], KV bytes)."""
  params, config, _, _ = read_model(source)
  model = Transformer(config)
  params = store(params, cell.weights)
  cache_config = CacheConfig(dtype=cell.cache)

  def run(prompts: np.ndarray, new_tokens: int):
    batch, prompt = prompts.shape
    start = time.perf_counter()
    logits, cache = decode.prefill(
      model,
      params,
      prompts,
      np.full((batch,), prompt, np.int32),
      prompt + new_tokens - 1,
      logits="last",
      cache_config=cache_config,
    )
    tokens = [np.asarray(jnp.argmax(logits, -1))]
    kv_bytes = cache.nbytes
    prefilled = time.perf_counter()
    for _ in range(new_tokens - 1):
      logits, cache = decode.decode_step(model, params, cache, tokens[-1])
      tokens.append(np.asarray(jnp.argmax(logits, -1)))
    end = time.perf_counter()
    return prefilled - start, end - prefilled, np.stack(tokens, 1), kv_bytes

  return run


def hf_in_format(torch, hf_model, weights: str):
  """transformers' float32 model in the weight format `weights` (float32, bfloat16, int8)."""
  if weights == "bfloat16":
    return hf_model.to(torch.bfloat16)
  if weights == "int8":
    return torch.ao.quantization.quantize_dynamic(hf_model, {torch.nn.Linear}, dtype=torch.qint8)
  return hf_model


def hf_side(source: str, cell: Cell):
  """run(prompts int32[B, P], new_tokens) -> (prefill s, decode s, ids int32[B, N], KV bytes)."""
  torch, transformers = import_torch()
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  model = hf_in_format(torch, hf_reference(resolve_source(source)), cell.weights)

  def run(prompts: np.ndarray, new_tokens: int):
    prompt = prompts.shape[1]
    ids = torch.from_numpy(prompts.astype(np.int64))
    with torch.inference_mode():
      start = time.perf_counter()
      if cell.cache == "static":
        past = transformers.StaticCache(config=model.config, max_cache_len=prompt + new_tokens)
      else:
        past = transformers.DynamicCache(config=model.config)
      out = model(ids, cache=past, use_cache=True, logits_to_keep=1)
      tokens = [out.logits[:, -1].argmax(-1)]
      prefilled = time.perf_counter()
      for step in range(new_tokens - 1):
        position = torch.tensor([prompt + step])
        out = model(tokens[-1][:, None], cache=past, use_cache=True, cache_position=position)
        tokens.append(out.logits[:, -1].argmax(-1))
      end = time.perf_counter()
    kv_bytes = sum(t.nbytes for layer in past.layers for t in (layer.keys, layer.values))
    return prefilled - start, end - prefilled, torch.stack(tokens, 1).numpy().astype(np.int32), kv_bytes

  return run


def run_spec(spec: dict) -> dict:
  """One cell's request, as `python -m kvjax.bench.real_long SPEC.json` runs it: spec holds
  source, cell (Cell's fields), prompts (a .npy of int32[B, P]) and ids (where the generated
  int32[B, N] go). Returns the cell's JSON-ready figures."""
  cell = Cell(**spec["cell"])
  prompts = np.load(spec["prompts"])
  run = (kvjax_side if cell.side == "kvjax" else hf_side)(spec["source"], cell)
  if cell.side == "kvjax":
    run(prompts, 3)  # compiles prefill at this shape and the decode step
  else:
    run(prompts[:, :WARMUP_PROMPT], 3)
  loaded_peak = peak_memory_gib()
  reset_peak_memory()
  prefill_s, decode_s, ids, kv_bytes = run(prompts, cell.new_tokens)
  request_peak = peak_memory_gib()
  np.save(spec["ids"], ids)
  batch, steps = cell.batch, cell.new_tokens - 1
  return {
    **dataclasses.asdict(cell),
    "name": cell.name,
    "prefill_s": prefill_s,
    "decode_s": decode_s,
    "request_s": prefill_s + decode_s,
    "prefill_tokens_per_s": batch * cell.prompt / prefill_s,
    "decode_tokens_per_s": batch * steps / decode_s if steps else None,
    "decode_ms_per_step": 1e3 * decode_s / steps if steps else None,
    "kv_bytes": int(kv_bytes),
    "request_peak_gib": request_peak,
    "peak_gib": None if request_peak is None else max(loaded_peak, request_peak),
  }
