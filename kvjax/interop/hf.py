"""Hugging Face import: a config.json + safetensors directory -> (kvjax params, ModelConfig).

Supported families (`model_type` in config.json):
  llama  - RMSNorm, SwiGLU, rotate-half RoPE; optional attention / MLP biases.
  qwen2  - Llama layout with q/k/v biases; tied embeddings on the small sizes.
  gpt2   - LayerNorm, tanh-GELU, learned positions, biases everywhere, fused Conv1D c_attn.

Layout conversions (HF -> kvjax; D model dim, N query heads, K kv heads, H head dim, F MLP):
  nn.Linear weight [out, in]          -> Dense kernel [in, out]
  q_proj [N*H, D], k/v_proj [K*H, D]  -> q kernel [D, N, H], k/v kernel [D, K, H]
  o_proj [D, N*H]                     -> out kernel [N, H, D]
  GPT-2 Conv1D weight [in, out]; c_attn [D, 3*D] holds q, k, v side by side.
HF's repeat_kv gives query head n the kv head n // G, the same rule as `kv_head_of`, so
heads map one to one. Tensors are read with safetensors' numpy backend (never pickle) and
returned as float32 numpy arrays in the tree `Transformer(config).init` would build.

The directory's files are read by kvjax.interop.hf_files: only those the checkpoint declares
(the shards model.safetensors.index.json names, or model.safetensors), each checked, and a
tokenizer.json beside them must load and fit the model's vocabulary.

`kvjax import-hf HF_DIR --workdir OUT` (kvjax.conversion.import_hf) writes them as a params
checkpoint that eval, generate and uptrain load, and copies tokenizer.json beside it when there
is one; every workdir derived from that one carries it on and tokenizes with it.
"""

from __future__ import annotations

import pathlib
from typing import Callable

import jax
import numpy as np

from kvjax import memory
from kvjax.config import ModelConfig
# The file readers are part of this module's public names (kvjax.interop.hf.load_tokenizer, ...).
from kvjax.interop.hf_files import (TOKENIZER_FILE, TensorFiles, copy_tokenizer, load_tokenizer,  # noqa: F401
                                    read_hf_config)
from kvjax.model.params import abstract_params

SUPPORTED = ("llama", "qwen2", "gpt2")
# Buffers some checkpoints carry that hold no weights: rotary tables and GPT-2's causal masks.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def _require(hf: dict, *keys: str):
  missing = [k for k in keys if hf.get(k) is None]
  if missing:
    raise ValueError(f"config.json of model_type {hf.get('model_type')!r} lacks {missing}")
  return [hf[k] for k in keys]


def _rope_theta(hf: dict) -> float:
  """rope_theta from either layout: top level (transformers 4) or rope_parameters (5)."""
  for key in ("rope_scaling", "rope_parameters"):
    params = hf.get(key) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
      raise ValueError(f"config.json {key} of type {kind!r} is not supported; only plain RoPE is")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"config.json {key}.partial_rotary_factor="
                       f"{params['partial_rotary_factor']} is not supported")
  theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10_000.0
  return float(theta)


def _dtype(hf: dict, dtype: str | None) -> str:
  if dtype is not None:
    return dtype
  stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if stored not in DTYPES:
    raise ValueError(f"config.json dtype {stored!r} is not supported; expected one of {tuple(DTYPES)}")
  return DTYPES[stored]


def config_from_hf(hf: dict, *, dtype: str | None = None) -> ModelConfig:
  """Maps a parsed config.json onto ModelConfig; ValueError names anything kvjax cannot express.

  dtype: kvjax compute dtype; defaults to the checkpoint's stored dtype (float32 if absent).
  """
  kind = hf.get("model_type")
  if kind not in SUPPORTED:
    arch = hf.get("architectures")
    raise ValueError(f"model_type {kind!r} (architectures {arch}) is not supported; "
                     f"kvjax imports {SUPPORTED}")
  dtype = _dtype(hf, dtype)
  if kind == "gpt2":
    return _gpt2_config(hf, dtype)
  vocab, d_model, layers, heads, mlp_dim, max_len = _require(
      hf, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
      "intermediate_size", "max_position_embeddings")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json hidden_act={act!r} is not supported; kvjax's SwiGLU uses 'silu'")
  if kind == "qwen2":
    sliding = hf.get("use_sliding_window") or any(
        t != "full_attention" for t in hf.get("layer_types") or ())
    if sliding:
      raise ValueError("config.json enables sliding-window attention, which kvjax does not support")
    qkv_bias, use_bias = True, False
  else:
    qkv_bias = bool(hf.get("attention_bias", False))
    # kvjax has one flag for the output and MLP biases; a family that has only one of them
    # gets zeros for the other, which computes the same function.
    use_bias = qkv_bias or bool(hf.get("mlp_bias", False))
  return ModelConfig(
      vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or d_model // heads, mlp_dim=mlp_dim,
      activation="swiglu", norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      positions="rope", rope_theta=_rope_theta(hf), qkv_bias=qkv_bias, use_bias=use_bias,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), max_len=max_len, dtype=dtype)


def _gpt2_config(hf: dict, dtype: str) -> ModelConfig:
  vocab, d_model, layers, heads, max_len = _require(
      hf, "vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
  act = hf.get("activation_function", "gelu_new")
  if act not in TANH_GELUS:
    raise ValueError(f"config.json activation_function={act!r} is not supported; "
                     f"kvjax's GELU is the tanh approximation {TANH_GELUS}")
  for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
    if hf.get(key, wanted) != wanted:
      raise ValueError(f"config.json {key}={hf[key]!r} is not supported (kvjax needs {wanted})")
  return ModelConfig(
      vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=heads, num_kv_heads=heads,
      mlp_dim=hf.get("n_inner") or 4 * d_model, activation="gelu", norm="layernorm",
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positions="learned",
      qkv_bias=True, use_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      max_len=max_len, dtype=dtype)


# A plan entry: kvjax parameter path, HF tensor name (None: zeros), conversion of that tensor.
Entry = tuple[tuple[str, ...], str | None, Callable[[np.ndarray], np.ndarray]]


def _llama_plan(cfg: ModelConfig, names: set[str]) -> list[Entry]:
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
  t = lambda w: w.T
  same = lambda w: w
  plan: list[Entry] = [(("embed", "embedding"), "embed_tokens.weight", same),
                       (("final_norm", "scale"), "norm.weight", same)]
  if not cfg.tie_embeddings:
    plan.append((("lm_head", "kernel"), "lm_head.weight", t))
  for i in range(cfg.num_layers):
    src, dst = f"layers.{i}.", f"layers_{i}"
    plan += [((dst, "attn_norm", "scale"), src + "input_layernorm.weight", same),
             ((dst, "mlp_norm", "scale"), src + "post_attention_layernorm.weight", same),
             ((dst, "attn", "q", "kernel"), src + "self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, h)),
             ((dst, "attn", "k", "kernel"), src + "self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, h)),
             ((dst, "attn", "v", "kernel"), src + "self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, h)),
             ((dst, "attn", "out", "kernel"), src + "self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d))]
    if cfg.qkv_bias:
      plan += [((dst, "attn", "q", "bias"), src + "self_attn.q_proj.bias", lambda b: b.reshape(n, h)),
               ((dst, "attn", "k", "bias"), src + "self_attn.k_proj.bias", lambda b: b.reshape(k, h)),
               ((dst, "attn", "v", "bias"), src + "self_attn.v_proj.bias", lambda b: b.reshape(k, h))]
    for proj in ("gate", "up", "down"):
      plan.append(((dst, "mlp", proj, "kernel"), f"{src}mlp.{proj}_proj.weight", t))
    if cfg.use_bias:
      optional = [((dst, "attn", "out", "bias"), src + "self_attn.o_proj.bias")]
      optional += [((dst, "mlp", p, "bias"), f"{src}mlp.{p}_proj.bias") for p in ("gate", "up", "down")]
      # Present in the checkpoint or, for the family without it, zero (see config_from_hf).
      plan += [(path, name if name in names else None, same) for path, name in optional]
  return plan


def _gpt2_plan(cfg: ModelConfig, names: set[str]) -> list[Entry]:
  n, h, d = cfg.num_heads, cfg.head_dim, cfg.d_model
  same = lambda w: w
  plan: list[Entry] = [(("embed", "embedding"), "wte.weight", same),
                       (("pos_embed", "embedding"), "wpe.weight", same),
                       (("final_norm", "scale"), "ln_f.weight", same),
                       (("final_norm", "bias"), "ln_f.bias", same)]
  if not cfg.tie_embeddings:
    plan.append((("lm_head", "kernel"), "lm_head.weight", lambda w: w.T))
  for i in range(cfg.num_layers):
    src, dst = f"h.{i}.", f"layers_{i}"
    for j, proj in enumerate(("q", "k", "v")):
      cols = slice(j * d, (j + 1) * d)
      plan += [((dst, "attn", proj, "kernel"), src + "attn.c_attn.weight",
                lambda w, cols=cols: w[:, cols].reshape(d, n, h)),
               ((dst, "attn", proj, "bias"), src + "attn.c_attn.bias",
                lambda b, cols=cols: b[cols].reshape(n, h))]
    plan += [((dst, "attn", "out", "kernel"), src + "attn.c_proj.weight", lambda w: w.reshape(n, h, d)),
             ((dst, "attn", "out", "bias"), src + "attn.c_proj.bias", same),
             ((dst, "mlp", "up", "kernel"), src + "mlp.c_fc.weight", same),
             ((dst, "mlp", "up", "bias"), src + "mlp.c_fc.bias", same),
             ((dst, "mlp", "down", "kernel"), src + "mlp.c_proj.weight", same),
             ((dst, "mlp", "down", "bias"), src + "mlp.c_proj.bias", same)]
    for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      plan += [((dst, norm, "scale"), f"{src}{ln}.weight", same),
               ((dst, norm, "bias"), f"{src}{ln}.bias", same)]
  return plan


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, prefix + (key,)))
    else:
      flat[prefix + (key,)] = value
  return flat


def _converted_shape(convert: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...]):
  """The shape `convert` makes of a tensor of `shape` (traced, nothing read), or None when it cannot apply."""
  try:
    return jax.eval_shape(convert, jax.ShapeDtypeStruct(shape, np.float32)).shape
  except (TypeError, ValueError):  # a reshape or slice that does not fit
    return None


def _check_coverage(plan: list[Entry], tensors: TensorFiles, cfg: ModelConfig, kind: str) -> None:
  names = tensors.names()
  wanted = {name for _, name, _ in plan if name is not None}
  missing = sorted(wanted - names)
  if missing:
    raise ValueError(f"{kind} checkpoint lacks {len(missing)} tensor(s): {missing[:8]}"
                     + (" ..." if len(missing) > 8 else ""))
  spare = names - wanted
  if cfg.tie_embeddings:
    spare.discard("lm_head.weight")  # a saved copy of the tied embedding
  spare = sorted(s for s in spare if not s.endswith(IGNORED_SUFFIXES))
  if spare:
    raise ValueError(f"{kind} checkpoint has {len(spare)} tensor(s) the config does not account for "
                     f"(an unsupported feature?): {spare[:8]}" + (" ..." if len(spare) > 8 else ""))


def from_hf(hf_dir: str | pathlib.Path, *, dtype: str | None = None) -> tuple[dict, ModelConfig]:
  """Reads a Hugging Face Llama / Qwen2 / GPT-2 directory into kvjax.

  Args:
    hf_dir: holds config.json and model.safetensors, or shards with model.safetensors.index.json.
    dtype: kvjax compute dtype; defaults to the checkpoint's stored dtype.
  Returns:
    (params, config): params is the {'embed': ..., 'layers_0': ...} tree of float32 numpy
    arrays for `Transformer(config).apply({'params': params}, ...)`.
  Raises:
    ValueError naming the unsupported architecture or feature; the missing, unexpected or
    misshapen tensors; a missing or damaged file (each named); a tokenizer.json that does not
    load or has ids past vocab_size; a model too large for host memory.
  """
  hf = read_hf_config(hf_dir)
  cfg = config_from_hf(hf, dtype=dtype)
  kind = hf["model_type"]
  # The weights become float32 numpy arrays in host memory; refuse a model that cannot fit there
  # (or whose config.json claims absurd sizes) before tracing or reading anything.
  memory.check_fits(f"importing {hf_dir}", {"float32 parameters": memory.param_bytes(cfg)},
                    limit=memory.host_limit())
  load_tokenizer(hf_dir, cfg.vocab_size)  # a tokenizer.json that cannot serve this model is refused
  tensors = TensorFiles(hf_dir)
  plan = (_gpt2_plan if kind == "gpt2" else _llama_plan)(cfg, tensors.names())
  _check_coverage(plan, tensors, cfg, kind)
  shapes = _flatten(abstract_params(cfg))
  planned = {path for path, _, _ in plan}
  if planned != set(shapes):
    # A plan that misses a kvjax parameter is a bug in this module, not in the checkpoint.
    raise AssertionError(f"import plan and kvjax tree differ: {sorted(planned ^ set(shapes))}")
  for path, name, convert in plan:  # every dtype and shape from the file headers, before reading data
    if name is not None and _converted_shape(convert, tensors.shape(name)) != shapes[path].shape:
      raise ValueError(f"tensor {name} of shape {tensors.shape(name)} in {tensors.where(name)} does not fit "
                       f"kvjax parameter {'/'.join(path)} of shape {shapes[path].shape} implied by config.json")
  params: dict = {}
  for path, name, convert in plan:
    value = np.zeros(shapes[path].shape, np.float32) if name is None else convert(tensors.get(name))
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.ascontiguousarray(value, dtype=np.float32)
  return params, cfg
