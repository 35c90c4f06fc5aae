"""The Llama family (Llama 2/3, SmolLM, Mistral-style) and the llama-like core other families share.

Llama: RMSNorm, SwiGLU, rotate-half RoPE (optionally Llama-3 scaled), optional attention / MLP
biases. The core (`hf_config`, `gguf_config`, `tensors`) reads the config keys and the tensor
layout every llama-like family has; a family over it (kvjax.interop.qwen2) says only what it
does differently: its biases and the sliding window it refuses. `to_hf_config` is `hf_config`'s
inverse, for export (kvjax.interop.hf_export).

llama.cpp stores a Llama's q and k rows permuted so that its interleaved-pair RoPE computes HF's
rotate-half one; `unpermute_rows` undoes it. It leaves Qwen2's rows alone (it rotates them
NeoX-style, as HF does).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from kvjax.config import ModelConfig, RopeScaling
from kvjax.interop.family import Family, Tensor, gguf_int, gguf_rope_fields, nonzero, require
from kvjax.interop.gguf_file import GGUFFile

LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")  # RopeScaling's, as config.json names them


def rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
  """(rope_theta, rope_scaling) from either layout: transformers 4's top-level rope_theta beside
  rope_scaling, or transformers 5's rope_parameters holding both. Plain RoPE and rope_type
  "llama3" map; any other rope_type (or a partial rotary factor) is refused by name.

  original_max_position_embeddings is read as transformers reads it: a top-level one first, then
  the rope dict's, then max_position_embeddings.
  """
  scaling = None
  for key in ("rope_scaling", "rope_parameters"):
    params = hf.get(key) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"config.json {key}.partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    if kind == "default":
      continue
    if kind != "llama3":
      raise ValueError(
        f"config.json {key} of type {kind!r} is not supported; kvjax reads plain RoPE ('default') and 'llama3'"
      )
    missing = [name for name in LLAMA3_FIELDS if params.get(name) is None]
    if missing:
      raise ValueError(f"config.json {key} of type 'llama3' lacks {missing}")
    original = (
      hf.get("original_max_position_embeddings")
      or params.get("original_max_position_embeddings")
      or hf.get("max_position_embeddings")
    )
    try:
      scaling = RopeScaling(kind=kind, original_max_position=original, **{name: params[name] for name in LLAMA3_FIELDS})
    except ValueError as e:
      raise ValueError(f"config.json {key}: {e}") from None
  theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10_000.0
  return float(theta), scaling


def hf_config(hf: dict, dtype: str, biases: Callable[[dict], tuple[bool, bool]]) -> ModelConfig:
  """ModelConfig from the config.json keys llama-like families share. biases(hf) reads the
  family's own keys -> (qkv_bias, use_bias), refusing by name what the family has and kvjax lacks
  (a sliding window)."""
  vocab, d_model, layers, heads, mlp_dim, max_len = require(
    hf,
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
  )
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json hidden_act={act!r} is not supported; kvjax's SwiGLU uses 'silu'")
  qkv_bias, use_bias = biases(hf)
  rope_theta, rope_scaling = rope_from_hf(hf)
  return ModelConfig(
    vocab_size=vocab,
    d_model=d_model,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or d_model // heads,
    mlp_dim=mlp_dim,
    activation="swiglu",
    norm="rmsnorm",
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    positions="rope",
    rope_theta=rope_theta,
    rope_scaling=rope_scaling,
    qkv_bias=qkv_bias,
    use_bias=use_bias,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_len=max_len,
    dtype=dtype,
  )


def _hf_biases(hf: dict) -> tuple[bool, bool]:
  """Llama's attention_bias and mlp_bias; Mistral's sliding window refused where it binds."""
  max_len = hf["max_position_embeddings"]
  if hf.get("sliding_window") and hf.get("model_type") == "mistral":
    if hf["sliding_window"] < max_len:
      raise ValueError(
        f"config.json sliding_window={hf['sliding_window']} (below max_position_embeddings={max_len}) is not supported"
      )
  qkv_bias = bool(hf.get("attention_bias", False))
  # kvjax has one flag for the output and MLP biases; a family that has only one of them
  # gets zeros for the other, which computes the same function.
  return qkv_bias, qkv_bias or bool(hf.get("mlp_bias", False))


def gguf_config(f: GGUFFile, dtype: str, biases: Callable[[GGUFFile], tuple[bool, bool]]) -> ModelConfig:
  """ModelConfig from llama.cpp's `{arch}.*` keys, which llama-like families share. biases(f) ->
  (qkv_bias, use_bias) for the family."""
  arch = f.architecture
  key = lambda name: f"{arch}.{name}"
  d_model = gguf_int(f, key("embedding_length"))
  heads = gguf_int(f, key("attention.head_count"))
  head_dim = gguf_int(f, key("attention.key_length"), d_model // heads)
  for other in ("attention.value_length", "rope.dimension_count"):
    value = gguf_int(f, key(other), head_dim)
    if value != head_dim:
      what = "partial rotary embeddings" if other.startswith("rope") else "values narrower or wider than keys"
      raise ValueError(
        f"{f.path}: metadata {key(other)}={value} differs from the head dim {head_dim} "
        f"({what}), which kvjax does not support"
      )
  scaling = f.metadata.get(key("rope.scaling.type"), "none")
  if scaling != "none":
    raise ValueError(
      f"{f.path}: metadata {key('rope.scaling.type')}={scaling!r} is not supported; kvjax imports plain RoPE from GGUF"
    )
  if "rope_freqs.weight" in f.names():
    raise ValueError(
      f"{f.path} holds rope_freqs.weight (per-frequency RoPE factors, Llama 3.1 style), "
      "which kvjax's GGUF import does not support"
    )
  if f.metadata.get(key("attention.sliding_window")):
    raise ValueError(
      f"{f.path}: metadata {key('attention.sliding_window')} enables sliding-window "
      "attention, which kvjax's GGUF import does not support"
    )
  embed_rows = f.shape("token_embd.weight")[0] if "token_embd.weight" in f.names() else None
  vocab = gguf_int(f, key("vocab_size"), embed_rows or len(f.metadata.get("tokenizer.ggml.tokens") or ()) or None)
  if embed_rows is not None and embed_rows != vocab:
    raise ValueError(
      f"{f.path}: metadata {key('vocab_size')}={vocab} contradicts token_embd.weight's {embed_rows} rows"
    )
  tokens = f.metadata.get("tokenizer.ggml.tokens")
  if tokens is not None and len(tokens) > vocab:
    raise ValueError(
      f"{f.path}: tokenizer.ggml.tokens lists {len(tokens)} tokens, more than the model's vocab_size={vocab}"
    )
  qkv_bias, use_bias = biases(f)
  return ModelConfig(
    vocab_size=vocab,
    d_model=d_model,
    num_layers=gguf_int(f, key("block_count")),
    num_heads=heads,
    head_dim=head_dim,
    activation="swiglu",
    rope_theta=float(f.metadata.get(key("rope.freq_base"), 10_000.0)),
    qkv_bias=qkv_bias,
    use_bias=use_bias,
    **gguf_rope_fields(f, dtype),
  )


def _gguf_biases(f: GGUFFile) -> tuple[bool, bool]:
  """A Llama with biases has them on q, k, v and the output alike."""
  has = "blk.0.attn_q.bias" in f.names()
  return has, has


def unpermute_rows(heads: int) -> Callable[[np.ndarray], np.ndarray]:
  """Undoes llama.cpp's permutation of a q or k projection's rows (or bias) over `heads` heads:
  within each head it stores the even rotary dims, then the odd ones, interleaved pairwise;
  HF (and kvjax) keep the first half of the head, then the second."""

  def fix(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

  return fix


def tensors(cfg: ModelConfig, names: set[str], *, gguf_permuted: bool = True) -> list[Tensor]:
  """The llama layout's tensors. gguf_permuted: llama.cpp stored the q / k rows permuted (Llama,
  not Qwen2)."""
  n, k = cfg.num_heads, cfg.num_kv_heads
  fix_q = unpermute_rows(n) if gguf_permuted else None
  fix_k = unpermute_rows(k) if gguf_permuted else None
  linear = dict(rows=1, linear=True)  # nn.Linear [out, in] -> Dense kernel [in, out...]
  plan = [
    Tensor(("embed", "embedding"), "embed_tokens.weight", "token_embd.weight", rows=1),
    Tensor(("final_norm", "scale"), "norm.weight", "output_norm.weight"),
  ]
  if not cfg.tie_embeddings:
    plan.append(Tensor(("lm_head", "kernel"), "lm_head.weight", "output.weight", **linear))
  for i in range(cfg.num_layers):
    hf, gg, kv = f"layers.{i}.", f"blk.{i}.", f"layers_{i}"
    attn = lambda proj, gguf, leaf="kernel", **layout: Tensor(
      (kv, "attn", proj, leaf),
      f"{hf}self_attn.{proj}_proj.{leaf_name(leaf)}",
      f"{gg}{gguf}.{leaf_name(leaf)}",
      **layout,
    )
    plan += [
      Tensor((kv, "attn_norm", "scale"), hf + "input_layernorm.weight", gg + "attn_norm.weight"),
      Tensor((kv, "mlp_norm", "scale"), hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight"),
      attn("q", "attn_q", gguf_fix=fix_q, **linear),  # [N*H, D] -> [D, N, H]
      attn("k", "attn_k", gguf_fix=fix_k, **linear),  # [K*H, D] -> [D, K, H]
      attn("v", "attn_v", **linear),
      Tensor(  # [D, N*H] -> [N, H, D]
        (kv, "attn", "out", "kernel"), hf + "self_attn.o_proj.weight", gg + "attn_output.weight", rows=2, linear=True
      ),
    ]
    if cfg.qkv_bias:
      plan += [attn("q", "attn_q", "bias", gguf_fix=fix_q), attn("k", "attn_k", "bias", gguf_fix=fix_k)]
      plan.append(attn("v", "attn_v", "bias"))
    for proj in ("gate", "up", "down"):
      plan.append(
        Tensor((kv, "mlp", proj, "kernel"), f"{hf}mlp.{proj}_proj.weight", f"{gg}ffn_{proj}.weight", **linear)
      )
    if cfg.use_bias:
      # Present in the checkpoint as its flags say or, for the family without them, zero (see _hf_biases).
      plan.append(
        Tensor(
          (kv, "attn", "out", "bias"), hf + "self_attn.o_proj.bias", gg + "attn_output.bias", when="attention_bias"
        )
      )
      plan += [
        Tensor((kv, "mlp", p, "bias"), f"{hf}mlp.{p}_proj.bias", f"{gg}ffn_{p}.bias", when="mlp_bias")
        for p in ("gate", "up", "down")
      ]
  return plan


def leaf_name(leaf: str) -> str:
  """A Dense leaf's checkpoint suffix: kernel -> weight, bias -> bias."""
  return "weight" if leaf == "kernel" else leaf


def rope_to_hf(config: ModelConfig) -> dict:
  """config.json's rope_parameters (the transformers 5 layout) for `rope_from_hf` to read back:
  plain RoPE, or rope_type "llama3" with the RopeScaling's fields under transformers' names."""
  out = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
  scaling = config.rope_scaling
  if scaling is not None:
    out.update(
      rope_type=scaling.kind,
      factor=scaling.factor,
      low_freq_factor=scaling.low_freq_factor,
      high_freq_factor=scaling.high_freq_factor,
      original_max_position_embeddings=scaling.original_max_position,
    )
  return out


def to_hf_config(config: ModelConfig, params: dict, biases: Callable[[ModelConfig, dict], dict]) -> dict:
  """The config.json keys `hf_config` reads, for `config` (its inverse). biases(config, params) ->
  the family's own bias keys. The RoPE settings go both as transformers 5's rope_parameters and
  as transformers 4's rope_theta (and rope_scaling), which it reads instead."""
  out = {
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.mlp_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": config.max_len,
    "rms_norm_eps": config.norm_eps,
    "rope_parameters": rope_to_hf(config),
    "rope_theta": float(config.rope_theta),
    "tie_word_embeddings": config.tie_embeddings,
    **biases(config, params),
  }
  if config.rope_scaling is not None:
    out["rope_scaling"] = {k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}
  return out


def _hf_biases_to(config: ModelConfig, params: dict) -> dict:
  """Llama's attention_bias (q, k, v and o) and mlp_bias, from the biases the model has: kvjax's
  use_bias covers o and the MLP together, so all-zero ones are left out, which is exact (an output
  bias without q / k / v ones is written beside zero q / k / v biases)."""
  layers = range(config.num_layers)
  out = [(f"layers_{i}", "attn", "out", "bias") for i in layers]
  mlp = [(f"layers_{i}", "mlp", p, "bias") for i in layers for p in ("gate", "up", "down")]
  return {
    "attention_bias": config.qkv_bias or (config.use_bias and nonzero(params, out)),
    "mlp_bias": config.use_bias and nonzero(params, mlp),
  }


LLAMA = Family(
  "llama",
  ("llama", "mistral"),
  ("llama",),
  functools.partial(hf_config, biases=_hf_biases),
  functools.partial(gguf_config, biases=_gguf_biases),
  tensors,
  functools.partial(to_hf_config, biases=_hf_biases_to),
  "LlamaForCausalLM",
  "model.",
)
