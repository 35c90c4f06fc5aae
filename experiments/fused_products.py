"""Would fusing a layer's q/k/v and gate/up products speed up a decode step? (docs/results.md)

SmolLM2-135M's shapes (d_model 576; q 576, k and v 192 each; gate and up 1,536 each), 30 layers
of distinct random weights, so that every product streams its weights from memory as a decode
step does. Two jitted functions compute the same products through the CPU kernel
(kvjax.kernels.matmul.small_matmul): "separate", five calls a layer as kvjax's Dense layers make
them; "fused", two calls a layer over the weights concatenated along their outputs ([576, 960] and
[576, 3,072]), as a fused parameter layout would. Alternated, best of `--repeats`; prints JSON.

  python experiments/fused_products.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels.matmul import small_matmul

D, F, LAYERS = 576, 1536, 30
SHAPES = dict(q=(D, 576), k=(D, 192), v=(D, 192), gate=(D, F), up=(D, F))


def layers_of(weights: dict, dtype) -> list[dict]:
  return [{n: jnp.asarray(w[i], dtype) for n, w in weights.items()} for i in range(LAYERS)]


def separate(x, layers):
  y = x
  for w in layers:
    q, k, v = (small_matmul(y, w[n]) for n in ("q", "k", "v"))
    g, u = small_matmul(y, w["gate"]), small_matmul(y, w["up"])
    y = y + 1e-3 * (q + jnp.pad(k + v, ((0, 0), (0, D - 192))) + (g + u)[:, :D])
  return y


def fused(x, layers):
  y = x
  for w in layers:
    qkv, gu = small_matmul(y, w["qkv"]), small_matmul(y, w["gate_up"])
    k, v = qkv[:, 576:768], qkv[:, 768:]
    y = y + 1e-3 * (qkv[:, :576] + jnp.pad(k + v, ((0, 0), (0, D - 192))) + (gu[:, :F] + gu[:, F:])[:, :D])
  return y


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  weights = {n: rng.standard_normal((LAYERS, *s), np.float32) * 0.02 for n, s in SHAPES.items()}
  joined = {
    "qkv": np.concatenate([weights["q"], weights["k"], weights["v"]], 2),
    "gate_up": np.concatenate([weights["gate"], weights["up"]], 2),
  }
  out = {}
  for fmt in ("float32", "bfloat16"):
    dtype = jnp.dtype(fmt)
    apart, together = layers_of(weights, dtype), layers_of(joined, dtype)
    for rows in (1, 8):
      x = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
      fns = {"separate": (jax.jit(separate), apart), "fused": (jax.jit(fused), together)}
      times = {name: [] for name in fns}
      for fn, ws in fns.values():
        fn(x, ws).block_until_ready()
      for _ in range(args.repeats):
        for name, (fn, ws) in fns.items():
          start = time.perf_counter()
          fn(x, ws).block_until_ready()
          times[name].append(time.perf_counter() - start)
      best = {name: min(t) * 1e3 for name, t in times.items()}
      out[f"{fmt}, {rows} row(s)"] = {
        "separate_ms": round(best["separate"], 2),
        "fused_ms": round(best["fused"], 2),
        "fused_speedup": round(best["separate"] / best["fused"], 3),
      }
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
