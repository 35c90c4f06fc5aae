"""Small GGUF files for the tests, written with gguf's own writer the way llama.cpp's converter
writes a Llama: q / k rows permuted for its interleaved RoPE, norms in F32, the other weights in
the type under test, a byte-level BPE tokenizer in the metadata.

`quantize_q4_k` is a plain Q4_K encoder (the gguf library decodes K-quants but does not encode
them): per 256-value super-block, 8 sub-blocks of 32 with 6-bit scales and mins.
"""

from __future__ import annotations

import numpy as np

# Byte-level BPE: single characters that spell themselves in GPT-2's byte alphabet, then merges.
CHARS = (
  [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("0123456789")
)
MERGED = ["ab", "cd", "abcd", "ef"]
TOKENS = ["<|endoftext|>", "<|im_end|>"] + CHARS + MERGED  # 2 + 62 + 4 = 68
MERGES = ["a b", "c d", "ab cd", "e f"]
VOCAB = len(TOKENS)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf row permutation of a q or k projection over `heads` heads."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_llama(
  seed: int = 0,
  *,
  d_model: int = 256,
  heads: int = 4,
  kv_heads: int = 2,
  mlp: int = 512,
  layers: int = 2,
  tied: bool = False,
) -> dict[str, np.ndarray]:
  """HF-named float32 weights ([out, in]) of a small random Llama."""
  rng = np.random.default_rng(seed)
  h = d_model // heads
  normal = lambda *shape: (rng.standard_normal(shape) * d_model**-0.5).astype(np.float32)
  w = {"embed_tokens.weight": normal(VOCAB, d_model) * 8, "norm.weight": 1 + 0.2 * normal(d_model) * 16}
  if not tied:
    w["lm_head.weight"] = normal(VOCAB, d_model)
  for i in range(layers):
    p = f"layers.{i}."
    w |= {
      p + "input_layernorm.weight": 1 + 0.2 * normal(d_model) * 16,
      p + "post_attention_layernorm.weight": 1 + 0.2 * normal(d_model) * 16,
      p + "self_attn.q_proj.weight": normal(heads * h, d_model),
      p + "self_attn.k_proj.weight": normal(kv_heads * h, d_model),
      p + "self_attn.v_proj.weight": normal(kv_heads * h, d_model),
      p + "self_attn.o_proj.weight": normal(d_model, heads * h),
      p + "mlp.gate_proj.weight": normal(mlp, d_model),
      p + "mlp.up_proj.weight": normal(mlp, d_model),
      p + "mlp.down_proj.weight": normal(d_model, mlp),
    }
  return w


GGUF_NAMES = {
  "embed_tokens.weight": "token_embd.weight",
  "norm.weight": "output_norm.weight",
  "lm_head.weight": "output.weight",
  "input_layernorm.weight": "attn_norm.weight",
  "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight",
  "self_attn.k_proj.weight": "attn_k.weight",
  "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight",
  "mlp.up_proj.weight": "ffn_up.weight",
  "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
  if hf.startswith("layers."):
    _, i, rest = hf.split(".", 2)
    return f"blk.{i}.{GGUF_NAMES[rest]}"
  return GGUF_NAMES[hf]


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
  """float32 [rows, cols] (cols a multiple of 256) -> Q4_K blocks uint8 [rows, cols / 256 * 144]."""
  rows, cols = x.shape
  sub = x.reshape(-1, 8, 32).astype(np.float64)  # [blocks, sub-block, value]
  low = np.minimum(sub.min(-1), 0)
  scale, minus = (sub.max(-1) - low) / 15, -low  # value = scale * q - minus, q in [0, 15]
  d = (scale.max(-1) / 63).astype(np.float16)
  dmin = (minus.max(-1) / 63).astype(np.float16)
  safe = lambda v: np.where(v == 0, 1, v)
  sc = np.clip(np.round(scale / safe(d.astype(np.float64))[:, None]), 0, 63).astype(np.uint8)
  mn = np.clip(np.round(minus / safe(dmin.astype(np.float64))[:, None]), 0, 63).astype(np.uint8)
  step = safe(d.astype(np.float64)[:, None] * sc)[..., None]
  q = np.clip(np.round((sub + (dmin.astype(np.float64)[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
  packed = np.zeros((len(sub), 12), np.uint8)
  packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
  packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
  packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
  qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(sub), 128)  # chunk j: sub-block 2j low, 2j + 1 high nibbles
  blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, qs], axis=1)
  return blocks.reshape(rows, cols // 256 * 144)


def write_llama(
  path,
  weights: dict[str, np.ndarray],
  qtype,
  *,
  heads: int = 4,
  kv_heads: int = 2,
  arch: str = "llama",
  merges: bool = True,
  skip: tuple[str, ...] = (),
  rope_theta: float = 5000.0,
  context: int = 64,
  types: dict | None = None,
  metadata: dict | None = None,
  omit: tuple[str, ...] = (),
) -> None:
  """A llama.cpp-style GGUF of HF-named `weights`, matrices stored as `qtype` (a GGMLQuantizationType)
  or as `types[name]`; `skip` leaves tensors out, `metadata` adds uint32 keys ({arch} in a key
  is the architecture), `omit` leaves out standard keys (e.g. "feed_forward_length")."""
  import gguf

  d_model = weights["embed_tokens.weight"].shape[1]
  layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
  writer = gguf.GGUFWriter(str(path), arch)
  standard = {
    "block_count": lambda: writer.add_block_count(layers),
    "context_length": lambda: writer.add_context_length(context),
    "embedding_length": lambda: writer.add_embedding_length(d_model),
    "feed_forward_length": lambda: writer.add_feed_forward_length(weights["layers.0.mlp.up_proj.weight"].shape[0]),
    "head_count": lambda: writer.add_head_count(heads),
    "head_count_kv": lambda: writer.add_head_count_kv(kv_heads),
    "rope_dimension_count": lambda: writer.add_rope_dimension_count(d_model // heads),
    "rope_freq_base": lambda: writer.add_rope_freq_base(rope_theta),
    "layer_norm_rms_eps": lambda: writer.add_layer_norm_rms_eps(1e-5),
  }
  for key, add in standard.items():
    if key not in omit:
      add()
  for key, value in (metadata or {}).items():
    writer.add_uint32(key.format(arch=arch), value)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(TOKENS)
  writer.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
  if merges:
    writer.add_token_merges(MERGES)
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(1)
  for name, w in weights.items():
    if name in skip:
      continue
    if name.endswith(("q_proj.weight", "k_proj.weight")):
      w = permute(w, heads if "q_proj" in name else kv_heads)
    data, raw_dtype = _encoded(w, (types or {}).get(name, qtype))
    writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _encoded(w: np.ndarray, qtype):
  """(array, raw dtype or None) for GGUFWriter.add_tensor: norms stay F32, as llama.cpp keeps them."""
  import gguf
  from gguf import GGMLQuantizationType as Q

  if w.ndim == 1 or qtype == Q.F32:
    return w.astype(np.float32), None
  if qtype == Q.F16:
    return w.astype(np.float16), None
  if qtype == Q.Q8_K:  # no encoder anywhere: zeros of the right size (a type the library cannot decode)
    return np.zeros((w.shape[0], w.shape[1] // 256 * 292), np.uint8), qtype
  return (quantize_q4_k(w) if qtype == Q.Q4_K else gguf.quants.quantize(w, qtype)), qtype
