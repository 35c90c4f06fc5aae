"""The GPT-2 family: LayerNorm, tanh-GELU, learned positions, biases everywhere, and one fused
Conv1D c_attn for q, k and v. Conv1D weights are stored [in, out] already, so kernels are sliced
and reshaped, not transposed. Read from safetensors only (llama.cpp's GPT-2 GGUF is not mapped)."""

from __future__ import annotations

from kvjax.config import ModelConfig
from kvjax.interop.family import Family, Tensor, require

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def config_from_hf(hf: dict, dtype: str) -> ModelConfig:
  vocab, d_model, layers, heads, max_len = require(hf, "vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
  act = hf.get("activation_function", "gelu_new")
  if act not in TANH_GELUS:
    raise ValueError(
      f"config.json activation_function={act!r} is not supported; kvjax's GELU is the tanh approximation {TANH_GELUS}"
    )
  for key, wanted in (
    ("scale_attn_weights", True),
    ("scale_attn_by_inverse_layer_idx", False),
    ("add_cross_attention", False),
  ):
    if hf.get(key, wanted) != wanted:
      raise ValueError(f"config.json {key}={hf[key]!r} is not supported (kvjax needs {wanted})")
  return ModelConfig(
    vocab_size=vocab,
    d_model=d_model,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=heads,
    mlp_dim=hf.get("n_inner") or 4 * d_model,
    activation="gelu",
    norm="layernorm",
    norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    positions="learned",
    qkv_bias=True,
    use_bias=True,
    tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    max_len=max_len,
    dtype=dtype,
  )


def tensors(cfg: ModelConfig, names: set[str]) -> list[Tensor]:
  n, h, d = cfg.num_heads, cfg.head_dim, cfg.d_model
  plan = [
    Tensor(("embed", "embedding"), "wte.weight", None),
    Tensor(("pos_embed", "embedding"), "wpe.weight", None),
    Tensor(("final_norm", "scale"), "ln_f.weight", None),
    Tensor(("final_norm", "bias"), "ln_f.bias", None),
  ]
  if not cfg.tie_embeddings:
    plan.append(Tensor(("lm_head", "kernel"), "lm_head.weight", None, lambda w: w.T))
  for i in range(cfg.num_layers):
    hf, kv = f"h.{i}.", f"layers_{i}"
    for j, proj in enumerate(("q", "k", "v")):
      cols = slice(j * d, (j + 1) * d)
      plan += [
        Tensor(
          (kv, "attn", proj, "kernel"),
          hf + "attn.c_attn.weight",
          None,
          lambda w, cols=cols: w[:, cols].reshape(d, n, h),
        ),
        Tensor((kv, "attn", proj, "bias"), hf + "attn.c_attn.bias", None, lambda b, cols=cols: b[cols].reshape(n, h)),
      ]
    plan += [
      Tensor((kv, "attn", "out", "kernel"), hf + "attn.c_proj.weight", None, lambda w: w.reshape(n, h, d)),
      Tensor((kv, "attn", "out", "bias"), hf + "attn.c_proj.bias", None),
      Tensor((kv, "mlp", "up", "kernel"), hf + "mlp.c_fc.weight", None),
      Tensor((kv, "mlp", "up", "bias"), hf + "mlp.c_fc.bias", None),
      Tensor((kv, "mlp", "down", "kernel"), hf + "mlp.c_proj.weight", None),
      Tensor((kv, "mlp", "down", "bias"), hf + "mlp.c_proj.bias", None),
    ]
    for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      plan += [
        Tensor((kv, norm, "scale"), f"{hf}{ln}.weight", None),
        Tensor((kv, norm, "bias"), f"{hf}{ln}.bias", None),
      ]
  return plan


GPT2 = Family("gpt2", ("gpt2",), (), config_from_hf, None, tensors)
