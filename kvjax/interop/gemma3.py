"""The Gemma 3 family (text models; GGUF general.architecture gemma3), read from GGUF.

What Gemma 3 has beyond the llama core, each a ModelConfig field: GeGLU (tanh-gelu(gate) * up),
RMSNorm over head_dim on every query and key head before RoPE (qk_norm), norms after attention
and after the MLP (post_norms), embeddings scaled by sqrt(d_model) (scale_embeddings), sliding
windows on five of every six layers (window, llama.cpp's and transformers' fixed pattern: layers
5, 11, 17, ... are global) whose RoPE base is 10,000 against the global layers' rope.freq_base
(rope_local_theta).

RMSNorm weights: Gemma computes x * (1 + w). llama.cpp's converter stored 1 + w in the GGUF;
transformers' GGUF loader subtracts 1 again and its Gemma3RMSNorm adds it back, both in float32.
kvjax keeps the scale the norm multiplies by, computed as 1 + (w_gguf - 1) in float32 (`_scale`),
so it is bitwise transformers' and the norm needs no (1 + w) flag.

The attention scale is query_pre_attn_scalar ** -0.5; kvjax scales by head_dim ** -0.5, so a
model whose scalar differs (llama.cpp: Gemma 3 27B, scaled by d_model / heads) is refused.
Logit soft-capping and RoPE scaling (the 4B and larger models' linear factor) are refused by name.

Safetensors (config.json model_type gemma3_text) is neither read nor written: the (1 + w) norm
layout has no Tensor field, so both directions are refused by name.
"""

from __future__ import annotations

import numpy as np

from kvjax.config import ModelConfig
from kvjax.interop.family import Family, Tensor, gguf_int, gguf_rope_fields
from kvjax.interop.gguf_file import GGUFFile

# Five local layers, then one global, over the depth (transformers' Gemma3TextConfig
# sliding_window_pattern, llama.cpp's set_swa_pattern(6)); not in the GGUF metadata.
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_BASE = 10_000.0  # transformers' rope_local_base_freq; llama.cpp's freq_base_swa default
REFUSED_KEYS = ("attn_logit_softcapping", "final_logit_softcapping", "rope.scaling.factor")
LAYERS_27B = 62  # llama.cpp scales the 27B's queries by (d_model / heads) ** -0.5, not head_dim's


def config_from_gguf(f: GGUFFile, dtype: str) -> ModelConfig:
  """ModelConfig from llama.cpp's gemma3.* metadata; ValueError naming a key kvjax cannot follow."""
  key = lambda name: f"gemma3.{name}"
  for name in REFUSED_KEYS:
    if f.metadata.get(key(name)):
      raise ValueError(f"{f.path}: metadata {key(name)}={f.metadata[key(name)]!r} is not supported for Gemma 3")
  scaling = f.metadata.get(key("rope.scaling.type"), "none")
  if scaling != "none":
    raise ValueError(f"{f.path}: metadata {key('rope.scaling.type')}={scaling!r} is not supported for Gemma 3")
  d_model = gguf_int(f, key("embedding_length"))
  heads = gguf_int(f, key("attention.head_count"))
  layers = gguf_int(f, key("block_count"))
  head_dim = gguf_int(f, key("attention.key_length"), d_model // heads)
  value_dim = gguf_int(f, key("attention.value_length"), head_dim)
  if value_dim != head_dim:
    raise ValueError(
      f"{f.path}: metadata {key('attention.value_length')}={value_dim} differs from key_length={head_dim}"
    )
  if layers == LAYERS_27B and d_model // heads != head_dim:
    raise ValueError(
      f"{f.path}: a Gemma 3 of {layers} layers scales its queries by query_pre_attn_scalar = d_model / heads = "
      f"{d_model // heads}, not head_dim={head_dim}, which kvjax's attention does not support"
    )
  window = gguf_int(f, key("attention.sliding_window"))
  embed_rows = f.shape("token_embd.weight")[0]
  vocab = gguf_int(f, key("vocab_size"), embed_rows)
  if vocab != embed_rows:
    raise ValueError(
      f"{f.path}: metadata {key('vocab_size')}={vocab} contradicts token_embd.weight's {embed_rows} rows"
    )
  return ModelConfig(
    vocab_size=vocab,
    d_model=d_model,
    num_layers=layers,
    num_heads=heads,
    head_dim=head_dim,
    activation="geglu",
    rope_theta=float(f.metadata.get(key("rope.freq_base"), 1_000_000.0)),
    rope_local_theta=float(f.metadata.get(key("rope.freq_base_swa"), ROPE_LOCAL_BASE)),
    window=(window,) * (SLIDING_WINDOW_PATTERN - 1) + (0,),
    qk_norm=True,
    post_norms=True,
    scale_embeddings=True,
    **gguf_rope_fields(f, dtype),
  )


def _scale(w: np.ndarray) -> np.ndarray:
  """The scale a Gemma RMSNorm multiplies by, from the GGUF's stored 1 + w: transformers' float32
  1 + (w_gguf - 1), which is not always w_gguf itself."""
  one = np.float32(1.0)
  return one + (np.asarray(w, np.float32) - one)


def tensors(cfg: ModelConfig, names: set[str]) -> list[Tensor]:
  """Every kvjax parameter of a Gemma 3 and its GGUF tensor (no safetensors names, see the module
  docstring). llama.cpp leaves the q / k rows unpermuted (it rotates Gemma NeoX-style)."""
  linear = dict(rows=1, linear=True)  # GGUF [out, in] -> Dense kernel [in, out...]
  norm = lambda path, gguf: Tensor(path, None, gguf, gguf_fix=_scale)
  plan = [
    Tensor(("embed", "embedding"), None, "token_embd.weight", rows=1),
    norm(("final_norm", "scale"), "output_norm.weight"),
  ]
  if not cfg.tie_embeddings:
    plan.append(Tensor(("lm_head", "kernel"), None, "output.weight", **linear))
  for i in range(cfg.num_layers):
    gg, kv = f"blk.{i}.", f"layers_{i}"
    plan += [
      norm((kv, "attn_norm", "scale"), gg + "attn_norm.weight"),
      norm((kv, "post_attn_norm", "scale"), gg + "post_attention_norm.weight"),
      norm((kv, "mlp_norm", "scale"), gg + "ffn_norm.weight"),
      norm((kv, "post_mlp_norm", "scale"), gg + "post_ffw_norm.weight"),
      norm((kv, "attn", "q_norm", "scale"), gg + "attn_q_norm.weight"),
      norm((kv, "attn", "k_norm", "scale"), gg + "attn_k_norm.weight"),
      Tensor((kv, "attn", "q", "kernel"), None, gg + "attn_q.weight", **linear),  # [N*H, D] -> [D, N, H]
      Tensor((kv, "attn", "k", "kernel"), None, gg + "attn_k.weight", **linear),  # [K*H, D] -> [D, K, H]
      Tensor((kv, "attn", "v", "kernel"), None, gg + "attn_v.weight", **linear),
      Tensor(
        (kv, "attn", "out", "kernel"), None, gg + "attn_output.weight", rows=2, linear=True
      ),  # [D, N*H] -> [N, H, D]
    ]
    plan += [Tensor((kv, "mlp", p, "kernel"), None, f"{gg}ffn_{p}.weight", **linear) for p in ("gate", "up", "down")]
  return plan


def config_from_hf(hf: dict, dtype: str) -> ModelConfig:
  raise ValueError(
    f"config.json model_type {hf.get('model_type')!r} (Gemma 3) is read from GGUF only; "
    "give kvjax import the model's .gguf file"
  )


def config_to_hf(config: ModelConfig, params: dict) -> dict:
  raise ValueError("Gemma 3 (its 1 + w norms) is not written as safetensors; kvjax reads it from GGUF only")


GEMMA3 = Family(
  "gemma3",
  ("gemma3_text",),
  ("gemma3",),
  config_from_hf,
  config_from_gguf,
  tensors,
  config_to_hf,
  "Gemma3ForCausalLM",
  "model.",
)
