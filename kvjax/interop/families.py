"""Model families as data: FAMILIES, the one `Family` entry (kvjax.interop.family) of every
architecture kvjax imports and exports; kvjax.interop.importer picks one by config.json's
model_type or the GGUF's general.architecture, kvjax.interop.hf_export the first that holds the
model (one that gives its config back exactly before one that adds zero biases), and both
read only the entries.

  llama  - Llama 2/3, SmolLM, Mistral-style: RMSNorm, SwiGLU, rotate-half RoPE (optionally
           Llama-3 scaled), optional attention / MLP biases (kvjax.interop.llama, which also
           holds the llama-like core other families share).
  qwen2  - the llama core with q/k/v biases; tied embeddings on the small sizes (kvjax.interop.qwen2).
  gpt2   - LayerNorm, tanh-GELU, learned positions, biases everywhere, fused Conv1D c_attn
           (safetensors only; kvjax.interop.gpt2).
  gemma3 - GeGLU, q/k norms, post-norms, scaled embeddings, 1 + w norms, five local layers
           (window 512, RoPE base 10,000) to one global (GGUF only; kvjax.interop.gemma3).

Each family is one module whose entry maps its config to ModelConfig and back and lists its
tensors (their layouts read both ways);
adding a family is adding its entry here (a llama-like one is a thin module over the llama
core). The tokenizer is not per family: it is the model directory's tokenizer.json, or the one a
GGUF's `tokenizer.ggml.*` metadata describes (kvjax.interop.tokenizer).
"""

from __future__ import annotations

from kvjax.interop.gemma3 import GEMMA3
from kvjax.interop.gpt2 import GPT2
from kvjax.interop.llama import LLAMA
from kvjax.interop.qwen2 import QWEN2

FAMILIES = (LLAMA, QWEN2, GPT2, GEMMA3)
