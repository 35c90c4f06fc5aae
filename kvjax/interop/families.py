"""Model families as data: one `Family` entry per architecture kvjax imports.

An entry says how the family's config maps to ModelConfig (from a Hugging Face config.json and,
where llama.cpp writes the family, from GGUF metadata) and which tensor goes where: one list of
`Tensor`s naming, for every kvjax parameter, its safetensors name, its GGUF name and the layout
change. Adding a family is adding an entry to FAMILIES. The tokenizer is not per family: it is the
model directory's tokenizer.json, or the one a GGUF's `tokenizer.ggml.*` metadata describes
(kvjax.interop.tokenizer).

  llama  - Llama 2/3, SmolLM, Mistral-style: RMSNorm, SwiGLU, rotate-half RoPE (optionally
           Llama-3 scaled), optional attention / MLP biases.
  qwen2  - the Llama layout with q/k/v biases; tied embeddings on the small sizes.
  gpt2   - LayerNorm, tanh-GELU, learned positions, biases everywhere, fused Conv1D c_attn
           (safetensors only).

Layouts (source -> kvjax; D model dim, N query heads, K kv heads, H head dim):
  nn.Linear weight [out, in] (a GGUF 2-D tensor reads the same way) -> Dense kernel [in, out]
  q [N*H, D], k/v [K*H, D] -> q kernel [D, N, H], k/v kernel [D, K, H]; o [D, N*H] -> [N, H, D]
Query head n reads kv head n // G in HF's repeat_kv as in kvjax (`kv_head_of`): heads map one to one.
llama.cpp stores a Llama's q and k rows permuted so that its interleaved-pair RoPE computes HF's
rotate-half one; `unpermute_rows` undoes it. It leaves Qwen2's rows alone (it rotates them
NeoX-style, as HF does).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

from kvjax.config import ModelConfig, RopeScaling
from kvjax.interop.gguf_file import GGUFFile

HF, GGUF = "hf", "gguf"
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")  # RopeScaling's, as config.json names them


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One kvjax parameter and where each format keeps it.

  path: the kvjax parameter, e.g. ("layers_0", "attn", "q", "kernel").
  hf, gguf: the tensor's name in a safetensors checkpoint (without the 'model.' prefix) and in a
    GGUF file; None where that format cannot hold it.
  convert: [out, in]-layout source array -> the kvjax array.
  gguf_fix: applied to the GGUF array before `convert` (llama.cpp's row permutation).
  optional: absent from a checkpoint means zeros (a bias the family may or may not have).
  """

  path: tuple[str, ...]
  hf: str | None
  gguf: str | None
  convert: Callable[[np.ndarray], np.ndarray] = lambda w: w
  gguf_fix: Callable[[np.ndarray], np.ndarray] | None = None
  optional: bool = False

  def name(self, source: str) -> str | None:
    return self.hf if source == HF else self.gguf

  def read(self, source: str, array: np.ndarray) -> np.ndarray:
    if source == GGUF and self.gguf_fix is not None:
      array = self.gguf_fix(array)
    return self.convert(array)


@dataclasses.dataclass(frozen=True)
class Family:
  """How one architecture maps onto kvjax (see the module docstring).

  config_from_hf(config.json dict, dtype) and config_from_gguf(GGUFFile, dtype) -> ModelConfig,
  each refusing, by name, a key that is missing, contradictory or asks for what kvjax lacks;
  tensors(config, names in the checkpoint) -> the Tensor of every kvjax parameter.
  """

  name: str
  hf_model_types: tuple[str, ...]
  gguf_architectures: tuple[str, ...]
  config_from_hf: Callable[[dict, str], ModelConfig]
  config_from_gguf: Callable[[GGUFFile, str], ModelConfig] | None
  tensors: Callable[[ModelConfig, set[str]], list[Tensor]]


def require(hf: dict, *keys: str) -> list[Any]:
  """The values of config.json `keys`; ValueError naming the missing ones."""
  missing = [k for k in keys if hf.get(k) is None]
  if missing:
    raise ValueError(f"config.json of model_type {hf.get('model_type')!r} lacks {missing}")
  return [hf[k] for k in keys]


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


def _llama_hf_config(hf: dict, dtype: str) -> ModelConfig:
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
  if hf.get("model_type") == "qwen2":
    sliding = hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ())
    if sliding:
      raise ValueError("config.json enables sliding-window attention, which kvjax does not support")
    qkv_bias, use_bias = True, False
  else:
    if hf.get("sliding_window") and hf.get("model_type") == "mistral":
      if hf["sliding_window"] < max_len:
        raise ValueError(
          f"config.json sliding_window={hf['sliding_window']} (below max_position_embeddings="
          f"{max_len}) is not supported"
        )
    qkv_bias = bool(hf.get("attention_bias", False))
    # kvjax has one flag for the output and MLP biases; a family that has only one of them
    # gets zeros for the other, which computes the same function.
    use_bias = qkv_bias or bool(hf.get("mlp_bias", False))
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


def _gguf_int(f: GGUFFile, key: str, default: int | None = None) -> int:
  if default is not None and key not in f.metadata:
    return default
  value = f.require(key)
  if isinstance(value, list):
    raise ValueError(
      f"{f.path}: metadata {key} gives one value per layer ({value[:4]}...); kvjax needs one value for every layer"
    )
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{f.path}: metadata {key}={value!r} is not a positive integer")
  return value


def _llama_gguf_config(f: GGUFFile, dtype: str) -> ModelConfig:
  """ModelConfig from llama.cpp's `{arch}.*` keys (Llama and Qwen2 share them)."""
  arch = f.architecture
  key = lambda name: f"{arch}.{name}"
  d_model = _gguf_int(f, key("embedding_length"))
  heads = _gguf_int(f, key("attention.head_count"))
  head_dim = _gguf_int(f, key("attention.key_length"), d_model // heads)
  for other in ("attention.value_length", "rope.dimension_count"):
    value = _gguf_int(f, key(other), head_dim)
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
  vocab = _gguf_int(f, key("vocab_size"), embed_rows or len(f.metadata.get("tokenizer.ggml.tokens") or ()) or None)
  if embed_rows is not None and embed_rows != vocab:
    raise ValueError(
      f"{f.path}: metadata {key('vocab_size')}={vocab} contradicts token_embd.weight's {embed_rows} rows"
    )
  tokens = f.metadata.get("tokenizer.ggml.tokens")
  if tokens is not None and len(tokens) > vocab:
    raise ValueError(
      f"{f.path}: tokenizer.ggml.tokens lists {len(tokens)} tokens, more than the model's vocab_size={vocab}"
    )
  qkv_bias = arch == "qwen2" or "blk.0.attn_q.bias" in f.names()
  return ModelConfig(
    vocab_size=vocab,
    d_model=d_model,
    num_layers=_gguf_int(f, key("block_count")),
    num_heads=heads,
    num_kv_heads=_gguf_int(f, key("attention.head_count_kv"), heads),
    head_dim=head_dim,
    mlp_dim=_gguf_int(f, key("feed_forward_length")),
    activation="swiglu",
    norm="rmsnorm",
    norm_eps=float(f.require(key("attention.layer_norm_rms_epsilon"), (float, int))),
    positions="rope",
    rope_theta=float(f.metadata.get(key("rope.freq_base"), 10_000.0)),
    qkv_bias=qkv_bias,
    use_bias=qkv_bias and arch != "qwen2",
    tie_embeddings="output.weight" not in f.names(),
    max_len=_gguf_int(f, key("context_length")),
    dtype=dtype,
  )


def unpermute_rows(heads: int) -> Callable[[np.ndarray], np.ndarray]:
  """Undoes llama.cpp's permutation of a q or k projection's rows (or bias) over `heads` heads:
  within each head it stores the even rotary dims, then the odd ones, interleaved pairwise;
  HF (and kvjax) keep the first half of the head, then the second."""

  def fix(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

  return fix


def _llama_tensors(cfg: ModelConfig, names: set[str], *, gguf_permuted: bool = True) -> list[Tensor]:
  """gguf_permuted: llama.cpp stored the q / k rows permuted (Llama, not Qwen2)."""
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
      # Present in the checkpoint or, for the family without it, zero (see _llama_hf_config).
      plan.append(
        Tensor((kv, "attn", "out", "bias"), hf + "self_attn.o_proj.bias", gg + "attn_output.bias", optional=True)
      )
      plan += [
        Tensor((kv, "mlp", p, "bias"), f"{hf}mlp.{p}_proj.bias", f"{gg}ffn_{p}.bias", optional=True)
        for p in ("gate", "up", "down")
      ]
  return plan


def _gpt2_hf_config(hf: dict, dtype: str) -> ModelConfig:
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


def _gpt2_tensors(cfg: ModelConfig, names: set[str]) -> list[Tensor]:
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


LLAMA = Family("llama", ("llama", "mistral"), ("llama",), _llama_hf_config, _llama_gguf_config, _llama_tensors)
QWEN2 = Family(
  "qwen2",
  ("qwen2",),
  ("qwen2",),
  _llama_hf_config,
  _llama_gguf_config,
  functools.partial(_llama_tensors, gguf_permuted=False),
)
GPT2 = Family("gpt2", ("gpt2",), (), _gpt2_hf_config, None, _gpt2_tensors)
FAMILIES = (LLAMA, QWEN2, GPT2)
