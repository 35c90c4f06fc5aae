"""Hugging Face export: (kvjax params, ModelConfig) -> a config.json + model.safetensors directory
that `transformers` loads (`kvjax export-hf`).

Families: a kvjax model with RMSNorm, SwiGLU and RoPE is Llama-shaped. With q/k/v biases alone
it is written as qwen2; otherwise as llama (attention_bias covers q, k, v and o together, so an
output bias without q/k/v biases is written with zero q/k/v biases, which is exact). Layouts are
the inverse of kvjax.interop.importer's: Dense kernel [in, out] -> nn.Linear weight [out, in],
q kernel [D, N, H] -> q_proj [N*H, D], out kernel [N, H, D] -> o_proj [D, N*H]. A model with
learned positions, LayerNorm or GELU (GPT-2 shaped, or converted from GPT-2) has no Llama-family
equivalent and is refused rather than written approximately.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from kvjax.config import ModelConfig
from kvjax.interop.hf_files import TOKENIZER_FILE

WEIGHTS_FILE = "model.safetensors"


def family(config: ModelConfig) -> str:
  """ "llama" or "qwen2" for a Llama-shaped config; ValueError naming what has no equivalent."""
  unlike = [
    f"{name}={value!r}"
    for name, value, want in (
      ("positions", config.positions, "rope"),
      ("norm", config.norm, "rmsnorm"),
      ("activation", config.activation, "swiglu"),
      ("window", config.window if any(config.window) else (), ()),
    )
    if value != want
  ]
  if config.is_latent:
    unlike.append(f"kv_latent_rank={config.kv_latent_rank}")
  if unlike:
    raise ValueError(
      f"a model with {', '.join(unlike)} has no Hugging Face Llama / Qwen2 equivalent "
      "(export needs positions='rope', norm='rmsnorm', activation='swiglu', K/V attention "
      "and no sliding window)"
    )
  return "qwen2" if config.qkv_bias and not config.use_bias else "llama"


def _mlp_bias(params, config: ModelConfig) -> bool:
  """Whether the MLP biases must be written: kvjax's use_bias covers the attention output and the
  MLP together, Llama's mlp_bias the MLP alone, so all-zero MLP biases (e.g. an imported Llama with
  attention_bias only) are left out, which is exact."""
  return config.use_bias and any(
    np.any(np.asarray(_at(params, (f"layers_{i}", "mlp", p, "bias"))))
    for i in range(config.num_layers)
    for p in ("gate", "up", "down")
  )


def _rope_parameters(config: ModelConfig) -> dict:
  """config.json's rope_parameters (the transformers 5 layout): plain RoPE, or rope_type "llama3"
  with the RopeScaling's fields under transformers' names."""
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


def hf_config(config: ModelConfig, params) -> dict:
  """The config.json of the exported model."""
  kind = family(config)
  out = {
    "architectures": ["Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"],
    "model_type": kind,
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
    "rope_parameters": _rope_parameters(config),
    "rope_theta": float(config.rope_theta),
    "tie_word_embeddings": config.tie_embeddings,
    "torch_dtype": config.dtype,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
  }
  if config.rope_scaling is not None:  # transformers 4 reads the scaling here, beside the top-level rope_theta
    out["rope_scaling"] = {k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}
  if kind == "llama":
    out.update(attention_bias=config.qkv_bias or config.use_bias, mlp_bias=_mlp_bias(params, config))
  return out


def hf_tensors(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """kvjax params -> {HF tensor name: float32 array} in the family's layout."""
  family(config)
  d, n, k, h = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
  get = lambda *path: np.asarray(_at(params, path), np.float32)
  out = {"model.embed_tokens.weight": get("embed", "embedding"), "model.norm.weight": get("final_norm", "scale")}
  if not config.tie_embeddings:
    out["lm_head.weight"] = get("lm_head", "kernel").T
  attention_bias, mlp_bias = config.qkv_bias or config.use_bias, _mlp_bias(params, config)
  for i in range(config.num_layers):
    src, dst = f"layers_{i}", f"model.layers.{i}."
    attn = lambda proj, leaf: get(src, "attn", proj, leaf)
    out.update(
      {
        dst + "input_layernorm.weight": get(src, "attn_norm", "scale"),
        dst + "post_attention_layernorm.weight": get(src, "mlp_norm", "scale"),
        dst + "self_attn.q_proj.weight": attn("q", "kernel").reshape(d, n * h).T,
        dst + "self_attn.k_proj.weight": attn("k", "kernel").reshape(d, k * h).T,
        dst + "self_attn.v_proj.weight": attn("v", "kernel").reshape(d, k * h).T,
        dst + "self_attn.o_proj.weight": attn("out", "kernel").reshape(n * h, d).T,
      }
    )
    if attention_bias:
      for proj, heads in (("q", n), ("k", k), ("v", k)):
        bias = attn(proj, "bias") if config.qkv_bias else np.zeros((heads, h), np.float32)
        out[dst + f"self_attn.{proj}_proj.bias"] = bias.reshape(heads * h)
    if config.use_bias:
      out[dst + "self_attn.o_proj.bias"] = attn("out", "bias")
    for proj in ("gate", "up", "down"):
      out[dst + f"mlp.{proj}_proj.weight"] = get(src, "mlp", proj, "kernel").T
      if mlp_bias:
        out[dst + f"mlp.{proj}_proj.bias"] = get(src, "mlp", proj, "bias")
  return {name: np.ascontiguousarray(value) for name, value in out.items()}


def _at(tree, path):
  for key in path:
    if key not in tree:
      raise ValueError(f"params have no {'/'.join(path)}, which the model config implies")
    tree = tree[key]
  return tree


def export_hf(
  params, config: ModelConfig, out_dir: str | pathlib.Path, *, tokenizer: pathlib.Path | None = None
) -> dict:
  """Writes config.json and model.safetensors (and a copy of `tokenizer`, a tokenizer.json) into
  out_dir, which must not exist or be empty. Returns {"family", "files"}."""
  out = pathlib.Path(out_dir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"export directory {out} must not exist or be empty: nothing is written over files")
  tensors, hf = hf_tensors(params, config), hf_config(config, params)  # every check before a byte is written
  tokenizer_bytes = None if tokenizer is None else pathlib.Path(tokenizer).read_bytes()
  out.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  files = ["config.json", WEIGHTS_FILE]
  if tokenizer_bytes is not None:
    (out / TOKENIZER_FILE).write_bytes(tokenizer_bytes)
    files.append(TOKENIZER_FILE)
  return {"family": hf["model_type"], "files": files}
