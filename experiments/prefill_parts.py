"""Where a kvjax prefill spends its time: the whole prefill and each part alone at its shapes
(matmuls, attention per window, norms and RoPE, cache writes), wall and CPU ms per core, as JSON.
Settings from the environment: MODEL, B, T, FMT, R (docs/kernels.md)."""

import os

import flax.linen as nn
from kvjax.cache.base import scatter_rows
from kvjax.model.rope import apply_rope, frequencies
import time
import json
import numpy as np
import jax
import jax.numpy as jnp
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.model.weights import store
from kvjax.model import attention as A
from kvjax.decoding import decode

name = os.environ.get("MODEL", "smollm2-135m")
B = int(os.environ.get("B", 2))
T = int(os.environ.get("T", 2048))
fmt = os.environ.get("FMT", "float32")
R = int(os.environ.get("R", 3))
params, cfg, tok, _ = read_model(name)
model = Transformer(cfg)
p = store(params, fmt)


def t(fn, *a):
  jax.block_until_ready(fn(*a))
  w = []
  c = []
  for _ in range(R):
    s, cs = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*a))
    w.append(time.perf_counter() - s)
    c.append(time.process_time() - cs)
  return round(min(w) * 1e3, 1), round(min(c) * 1e3 / 2, 1)


res = {"model": name, "B": B, "T": T, "fmt": fmt}
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
lengths = np.full((B,), T, np.int32)
if os.environ.get("FULL", "1") == "1":
  res["prefill"] = t(lambda: decode.prefill(model, p, tokens, lengths, T + 256, logits="last")[0])
M = B * T
D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
wd = jnp.bfloat16 if fmt == "bfloat16" else jnp.float32
rng = np.random.default_rng(1)
x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
ws = {
  n: jnp.asarray(rng.standard_normal(s) * 0.02, wd)
  for n, s in dict(q=(D, N * H), k=(D, K * H), v=(D, K * H), o=(N * H, D), g=(D, F), u=(D, F), d=(F, D)).items()
}
mm = decode.cpu_backend().matmul


@jax.jit
def layer_mm(x, ws):
  q = mm(x, ws["q"])
  k = mm(x, ws["k"])
  v = mm(x, ws["v"])
  o = mm(q, ws["o"])
  h = jax.nn.silu(mm(o, ws["g"])) * mm(o, ws["u"])
  return mm(h, ws["d"]) + k.sum() + v.sum()


res["matmuls/layer"] = t(layer_mm, x, ws)
res["matmul GFLOP/layer"] = round(2 * M * (D * N * H * 2 + 2 * D * K * H + 3 * D * F) / 1e9, 2)
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
kk = jnp.asarray(rng.standard_normal((B, K, T, H)), jnp.float32)
vv = jnp.asarray(rng.standard_normal((B, K, T, H)), jnp.float32)
pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
for win in sorted({0, *(cfg.layer_window(i) for i in range(cfg.num_layers))}):
  vis = A.Visibility(pos, pos, A.Window(win))
  res[f"attention/layer window={win}"] = t(jax.jit(lambda q, k, v: A.attend_keys(q, k, v, vis)), q, kk, vv)
res["attention GFLOP/layer causal"] = round(4 * B * T * T / 2 * N * H / 1e9, 2)

rms = nn.RMSNorm(dtype=jnp.float32)
rp = rms.init(jax.random.key(0), x)

fr = frequencies(cfg.rope_theta, H, cfg.rope_scaling)


@jax.jit
def elementwise(x, q, k):
  y = rms.apply(rp, x)
  y = rms.apply(rp, y + x)
  return y.sum() + apply_rope(q, pos, fr).sum() + apply_rope(k, pos, fr).sum()


res["norms+rope/layer"] = t(elementwise, x, q, kk.transpose(0, 2, 1, 3))

buf = jnp.zeros((B, K, H, T + 256), jnp.float32)
res["cache write k+v/layer"] = t(
  jax.jit(lambda buf, k, v: (scatter_rows(buf, k.swapaxes(2, 3), pos, 3), scatter_rows(buf.swapaxes(2, 3), v, pos, 2))),
  buf,
  kk,
  vv,
)
res["layers"] = cfg.num_layers
print(json.dumps(res))
