"""The GPT-2 family: LayerNorm, tanh-GELU, learned positions, biases everywhere, and one fused
Conv1D c_attn for q, k and v. Conv1D weights are stored [in, out] already, so kernels are sliced
and reshaped, not transposed (and joined again on export). Read from safetensors only (llama.cpp's GPT-2 GGUF is not mapped)."""

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


def config_to_hf(config: ModelConfig, params: dict) -> dict:
  """The config.json keys `config_from_hf` reads, for `config` (its inverse)."""
  return {
    "vocab_size": config.vocab_size,
    "n_embd": config.d_model,
    "n_layer": config.num_layers,
    "n_head": config.num_heads,
    "n_positions": config.max_len,
    "n_inner": config.mlp_dim,
    "activation_function": TANH_GELUS[0],
    "layer_norm_epsilon": config.norm_eps,
    "tie_word_embeddings": config.tie_embeddings,
  }


def tensors(cfg: ModelConfig, names: set[str]) -> list[Tensor]:
  plan = [
    Tensor(("embed", "embedding"), "wte.weight", None, rows=1),
    Tensor(("pos_embed", "embedding"), "wpe.weight", None, rows=1),
    Tensor(("final_norm", "scale"), "ln_f.weight", None),
    Tensor(("final_norm", "bias"), "ln_f.bias", None),
  ]
  if not cfg.tie_embeddings:
    plan.append(Tensor(("lm_head", "kernel"), "lm_head.weight", None, rows=1, linear=True))
  for i in range(cfg.num_layers):
    hf, kv = f"h.{i}.", f"layers_{i}"
    for j, proj in enumerate(("q", "k", "v")):  # [D, 3*N*H]: q, k, v side by side; each [D, N, H]
      plan += [
        Tensor((kv, "attn", proj, "kernel"), hf + "attn.c_attn.weight", None, rows=1, part=(j, 3)),
        Tensor((kv, "attn", proj, "bias"), hf + "attn.c_attn.bias", None, part=(j, 3)),
      ]
    plan += [
      Tensor((kv, "attn", "out", "kernel"), hf + "attn.c_proj.weight", None, rows=2),  # [N*H, D] -> [N, H, D]
      Tensor((kv, "attn", "out", "bias"), hf + "attn.c_proj.bias", None),
      Tensor((kv, "mlp", "up", "kernel"), hf + "mlp.c_fc.weight", None, rows=1),
      Tensor((kv, "mlp", "up", "bias"), hf + "mlp.c_fc.bias", None),
      Tensor((kv, "mlp", "down", "kernel"), hf + "mlp.c_proj.weight", None, rows=1),
      Tensor((kv, "mlp", "down", "bias"), hf + "mlp.c_proj.bias", None),
    ]
    for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      plan += [
        Tensor((kv, norm, "scale"), f"{hf}{ln}.weight", None),
        Tensor((kv, norm, "bias"), f"{hf}{ln}.bias", None),
      ]
  return plan


GPT2 = Family("gpt2", ("gpt2",), (), config_from_hf, None, tensors, config_to_hf, "GPT2LMHeadModel", "transformer.")
