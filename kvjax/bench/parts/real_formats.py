"""The decode and prefill parts of `kvjax bench real`, format for format: every kvjax weight format
(kvjax.model.weights) beside transformers holding its weights the same way, and llama.cpp at
batch 1, every side's rounds alternated in one loop (kvjax.timing.timed_alternating).

  float32   kvjax float32         transformers float32 (the model load_both returns)
  bfloat16  kvjax bfloat16        a bfloat16 copy of it
  int8      kvjax int8            a copy through torch.ao.quantization.quantize_dynamic({Linear},
                                  qint8): every Linear, the lm_head included (its own int8 copy of
                                  the tied embedding), is int8 with one scale per tensor and
                                  activations quantized per call; the embedding and the norms stay
                                  float32 (`hf_int8` lists them)

A row is named `<side>_<format>` (kvjax_int8, hf_bfloat16, llamacpp_q8_0). Greedy agreement of a
row compares whole answers, prompt by prompt, with the float32 row of its side and with
kvjax_float32: the fraction of prompts whose whole answer is the same, and for each prompt the
first position where it differs (None: none).
"""

from __future__ import annotations

import copy
import re
import statistics

import jax
import numpy as np

from kvjax.bench.base.harness import greedy_agreement
from kvjax.bench.peers.llamacpp import FORMATS as LLAMACPP_FORMATS
from kvjax.bench.peers.llamacpp import LlamaCppPeer
from kvjax.bench.peers.hf_model import hf_greedy_kwargs, import_torch, peak_memory_gib, prose_prompts, reset_peak_memory
from kvjax.decoding import decode
from kvjax.model.weights import FORMATS, store, weight_bytes
from kvjax.timing import timed_alternating


def hf_formats(hf_model) -> tuple[dict, dict]:
  """({format: transformers model} for every kvjax weight format, what the int8 copy holds)."""
  torch, _ = import_torch()
  int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf_model), {torch.nn.Linear}, dtype=torch.qint8)
  quantized = [name for name, m in int8.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
  floats = {}
  for name, p in int8.named_parameters():
    kind = re.sub(r"\.\d+\.", ".N.", name)  # one entry per kind of tensor, not per layer
    floats[kind] = floats.get(kind, 0) + p.numel()
  lm_head = getattr(int8, "lm_head", None)
  notes = {
    "method": "torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)",
    "quantized_linears": len(quantized),
    "lm_head_quantized": isinstance(lm_head, torch.ao.nn.quantized.dynamic.Linear),
    "weight_qscheme": str(lm_head.weight().qscheme()) if lm_head is not None else None,
    "float32_parameters": floats,
  }
  models = {"float32": hf_model, "bfloat16": copy.deepcopy(hf_model).to(torch.bfloat16), "int8": int8}
  return models, notes


def _keeping(fn, outputs: dict, name: str):
  """fn, keeping its last output under outputs[name] (the timed calls give the answers compared)."""

  def run():
    out = jax.block_until_ready(fn())
    outputs[name] = out
    return out

  return run


def _hf_generate(torch, hf_model, prompts: np.ndarray, new_tokens: int):
  input_ids = torch.from_numpy(prompts.astype(np.int64))
  kwargs = hf_greedy_kwargs(torch, input_ids, new_tokens)

  def run():
    with torch.inference_mode():
      return hf_model.generate(input_ids, **kwargs)[:, prompts.shape[1] :].numpy()

  return run


def _ratios(row: dict, side: str, formats) -> None:
  """Each `side` row's tokens/s over transformers' in the same format and over transformers' best."""
  best = max(row[f"hf_{f}"]["tokens_per_s"] for f in FORMATS)
  for fmt in formats:
    peer = LLAMACPP_FORMATS.get(fmt, fmt) if side == "llamacpp" else fmt
    ours = row[f"{side}_{fmt}"]
    ours["over_hf_same_format"] = ours["tokens_per_s"] / row[f"hf_{peer}"]["tokens_per_s"]
    ours["over_hf_best"] = ours["tokens_per_s"] / best


def bench_decode(model, params, tokenizer, hf_models, bandwidth, *, batches, prompt, new_tokens, repeats, llamacpp):
  """Greedy generation, `prompt`-token prose prompts + `new_tokens`, at each batch size: every row
  timed in alternating rounds. llamacpp: {"python": ..., "gguf": ...} runs llama.cpp's rows at
  batch 1, or {"skipped": reason}."""
  torch, _ = import_torch()
  stored = {fmt: store(params, fmt) for fmt in FORMATS}
  rows = []
  for batch in batches:
    prompts = prose_prompts(tokenizer, batch, prompt)
    lengths = np.full((batch,), prompt, np.int32)
    fns = {
      f"kvjax_{f}": (lambda p=p: decode.generate(model, p, prompts, lengths, new_tokens)) for f, p in stored.items()
    }
    fns |= {f"hf_{f}": _hf_generate(torch, m, prompts, new_tokens) for f, m in hf_models.items()}
    peers = {}
    if batch == 1 and "python" in llamacpp:
      try:
        for fmt in LLAMACPP_FORMATS:
          peers[fmt] = LlamaCppPeer(llamacpp["python"], llamacpp["gguf"], fmt, prompts[0], new_tokens)
          fns[f"llamacpp_{fmt}"] = peers[fmt]
      except RuntimeError as err:  # its environment cannot load the model: the other rows still run
        llamacpp = {"skipped": str(err)}
        for fmt, peer in peers.items():
          peer.close()
          del fns[f"llamacpp_{fmt}"]
        peers = {}
    answers = {}
    try:
      times = timed_alternating({n: _keeping(fn, answers, n) for n, fn in fns.items()}, repeats)
    finally:
      for peer in peers.values():
        peer.close()
    row = {"batch": batch}
    for name in fns:
      side, fmt = name.split("_", 1)
      seconds = statistics.median(times[name])
      row[name] = {"tokens_per_s": batch * new_tokens / seconds, "seconds": times[name]}
      if side != "kvjax":
        row[name]["agreement_with_kvjax_float32"] = greedy_agreement(answers[name], answers["kvjax_float32"])
      if fmt not in ("float32", "f32"):
        own = "llamacpp_f32" if side == "llamacpp" else f"{side}_float32"
        row[name]["agreement_with_float32"] = greedy_agreement(answers[name], answers[own])
      if side == "kvjax":
        row[name]["weight_gb_per_s"] = weight_bytes(stored[fmt]) * new_tokens / seconds / 1e9
        row[name]["bandwidth_fraction"] = row[name]["weight_gb_per_s"] / bandwidth
    for fmt, peer in peers.items():
      row[f"llamacpp_{fmt}"] |= peer.figures()
      ours = row[f"kvjax_{LLAMACPP_FORMATS[fmt]}"]
      ours[f"over_llamacpp_{fmt}"] = ours["tokens_per_s"] / row[f"llamacpp_{fmt}"]["tokens_per_s"]
    _ratios(row, "kvjax", FORMATS)
    _ratios(row, "llamacpp", peers)
    rows.append(row)
  out = {"prompt": prompt, "new_tokens": new_tokens, "repeats": repeats}
  out["weight_bytes"] = {f: weight_bytes(p) for f, p in stored.items()}
  if "skipped" in llamacpp:
    out["llamacpp_skipped"] = llamacpp["skipped"]
  return out | {"rows": rows}


def bench_prefill(model, params, tokenizer, hf_models, *, batch, prompt, max_len, repeats):
  """kvjax's prefill (blocked attention, last logits) with the weights in each format against
  transformers' forward pass (SDPA, dynamic cache, last logits) in the same format, in alternating
  rounds; each row's peak resident memory over its calls (the process's, every model loaded), and
  the next token of each prompt against its side's float32."""
  torch, _ = import_torch()
  prompts = prose_prompts(tokenizer, batch, prompt)
  lengths = np.full((batch,), prompt, np.int32)
  ids = torch.from_numpy(prompts.astype(np.int64))

  def ours(p):
    return lambda: decode.prefill(model, p, prompts, lengths, max_len, logits="last")[0]

  def theirs(m):
    def run():
      with torch.inference_mode():
        return m(ids, use_cache=True, logits_to_keep=1).logits[:, -1].float().numpy()

    return run

  fns = {f"kvjax_{f}": ours(store(params, f)) for f in FORMATS} | {f"hf_{f}": theirs(m) for f, m in hf_models.items()}
  peaks = {name: 0.0 for name in fns}

  def measured(name, fn):
    def run():
      reset_peak_memory()
      out = jax.block_until_ready(fn())
      peaks[name] = max(peaks[name], peak_memory_gib() or 0.0)
      return out

    return run

  answers = {}
  times = timed_alternating({n: _keeping(measured(n, fn), answers, n) for n, fn in fns.items()}, repeats)
  out = {"batch": batch, "prompt": prompt, "repeats": repeats}
  for name in fns:
    seconds = statistics.median(times[name])
    side = name.split("_", 1)[0]
    same = np.argmax(np.asarray(answers[name]), -1) == np.argmax(np.asarray(answers[f"{side}_float32"]), -1)
    out[name] = {
      "seconds": seconds,
      "rounds_s": times[name],
      "tokens_per_s": batch * prompt / seconds,
      "peak_gib": peaks[name] or None,
      "next_token_agrees_with_float32": float(same.mean()),
    }
  _ratios(out, "kvjax", FORMATS)
  return out
