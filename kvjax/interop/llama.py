"""The Llama family (Llama 2/3, SmolLM, Mistral-style) and the llama-like core other families share.

Llama: RMSNorm, SwiGLU, rotate-half RoPE (optionally Llama-3 scaled), optional attention / MLP
biases. The core (`hf_config`, `gguf_config`, `tensors`) reads the config keys and the tensor
layout every llama-like family has; a family over it (kvjax.interop.qwen2) says only what it
does differently: its biases and the sliding window it refuses.

llama.cpp stores a Llama's q and k rows permuted so that its interleaved-pair RoPE computes HF's
rotate-half one; `unpermute_rows` undoes it. It leaves Qwen2's rows alone (it rotates them
NeoX-style, as HF does).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from kvjax.config import ModelConfig, RopeScaling
from kvjax.interop.family import Family, Tensor, gguf_int, require
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
    num_kv_heads=gguf_int(f, key("attention.head_count_kv"), heads),
    head_dim=head_dim,
    mlp_dim=gguf_int(f, key("feed_forward_length")),
    activation="swiglu",
    norm="rmsnorm",
    norm_eps=float(f.require(key("attention.layer_norm_rms_epsilon"), (float, int))),
    positions="rope",
    rope_theta=float(f.metadata.get(key("rope.freq_base"), 10_000.0)),
    qkv_bias=qkv_bias,
    use_bias=use_bias,
    tie_embeddings="output.weight" not in f.names(),
    max_len=gguf_int(f, key("context_length")),
    dtype=dtype,
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
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
  t = lambda w: w.T
  fix_q = unpermute_rows(n) if gguf_permuted else None
  fix_k = unpermute_rows(k) if gguf_permuted else None
  plan = [
    Tensor(("embed", "embedding"), "embed_tokens.weight", "token_embd.weight"),
    Tensor(("final_norm", "scale"), "norm.weight", "output_norm.weight"),
  ]
  if not cfg.tie_embeddings:
    plan.append(Tensor(("lm_head", "kernel"), "lm_head.weight", "output.weight", t))
  for i in range(cfg.num_layers):
    hf, gg, kv = f"layers.{i}.", f"blk.{i}.", f"layers_{i}"
    plan += [
      Tensor((kv, "attn_norm", "scale"), hf + "input_layernorm.weight", gg + "attn_norm.weight"),
      Tensor((kv, "mlp_norm", "scale"), hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight"),
      Tensor(
        (kv, "attn", "q", "kernel"),
        hf + "self_attn.q_proj.weight",
        gg + "attn_q.weight",
        lambda w: w.T.reshape(d, n, h),
        fix_q,
      ),
      Tensor(
        (kv, "attn", "k", "kernel"),
        hf + "self_attn.k_proj.weight",
        gg + "attn_k.weight",
        lambda w: w.T.reshape(d, k, h),
        fix_k,
      ),
      Tensor(
        (kv, "attn", "v", "kernel"),
        hf + "self_attn.v_proj.weight",
        gg + "attn_v.weight",
        lambda w: w.T.reshape(d, k, h),
      ),
      Tensor(
        (kv, "attn", "out", "kernel"),
        hf + "self_attn.o_proj.weight",
        gg + "attn_output.weight",
        lambda w: w.T.reshape(n, h, d),
      ),
    ]
    if cfg.qkv_bias:
      plan += [
        Tensor(
          (kv, "attn", "q", "bias"), hf + "self_attn.q_proj.bias", gg + "attn_q.bias", lambda b: b.reshape(n, h), fix_q
        ),
        Tensor(
          (kv, "attn", "k", "bias"), hf + "self_attn.k_proj.bias", gg + "attn_k.bias", lambda b: b.reshape(k, h), fix_k
        ),
        Tensor((kv, "attn", "v", "bias"), hf + "self_attn.v_proj.bias", gg + "attn_v.bias", lambda b: b.reshape(k, h)),
      ]
    for proj in ("gate", "up", "down"):
      plan.append(Tensor((kv, "mlp", proj, "kernel"), f"{hf}mlp.{proj}_proj.weight", f"{gg}ffn_{proj}.weight", t))
    if cfg.use_bias:
      # Present in the checkpoint or, for the family without it, zero (see _hf_biases).
      plan.append(
        Tensor((kv, "attn", "out", "bias"), hf + "self_attn.o_proj.bias", gg + "attn_output.bias", optional=True)
      )
      plan += [
        Tensor((kv, "mlp", p, "bias"), f"{hf}mlp.{p}_proj.bias", f"{gg}ffn_{p}.bias", optional=True)
        for p in ("gate", "up", "down")
      ]
  return plan


LLAMA = Family(
  "llama",
  ("llama", "mistral"),
  ("llama",),
  functools.partial(hf_config, biases=_hf_biases),
  functools.partial(gguf_config, biases=_gguf_biases),
  tensors,
)
