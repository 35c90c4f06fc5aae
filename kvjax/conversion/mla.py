"""MHA / GQA -> multi-head latent attention (MLA) checkpoint conversion, as a pure function
(after MHA2MLA, Ji et al. 2025: partial RoPE, then a joint low-rank factorisation of K and V).

Per layer, on the source model's attention inputs x [T, D] over calibration tokens:
  1. Partial RoPE. Each kv head keeps the W/2 = rope_dims / (2 K) rotary frequency pairs that
     contribute most to its query heads' scores, scored as ||q_pair|| ||k_pair|| (root mean
     square over the calibration tokens of the complex pair, summed over the kv head's query
     heads). The kept pairs of all K kv heads form the shared rotary key [K*W], each group in
     rotate-half order; their source frequencies go to ModelConfig.rope_pairs, so they rotate
     exactly as before. The other dims of every key (and of its queries) become position-free.
  2. Joint low rank. The position-free key projections and the value projections of all kv
     heads, stacked into M [D, K*(E + H)] (a bias row appended when the model has qkv biases),
     are factorised as M ~ A B with A [D, R] -> kv_down and B [R, K*(E + H)] -> k_up, v_up.
       "activation" (default): minimises ||X (M - A B)|| over the calibration inputs X (SVD of
                    L^T M with X^T X = L L^T), the error in the keys and values themselves.
       "svd":       the truncated SVD of M, the weights alone.
     Query head n's up-projections are the columns of its kv head kv_head_of(n).
Queries are only reordered (position-free dims first, then the kept pairs) and the output
projection is unchanged. With every frequency kept (rope_dims = K * head_dim) and R at the rank
of M the converted model computes the source's logits (up to float rounding).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.conversion import pca
from kvjax.conversion.kv_heads import check_calibration
from kvjax.model.keys import kv_head_of

FACTORISATIONS = ("activation", "svd")


def check_target(config: ModelConfig, rank: int, rope_dims: int) -> None:
  """Raises ValueError naming the value unless `config` (an MHA / GQA model) converts to latent
  rank `rank` with `rope_dims` rotary dims: checked before anything is computed."""
  if config.is_latent:
    raise ValueError(f"the model is already MLA (kv_latent_rank={config.kv_latent_rank})")
  check_positive_int(rank, "kv_latent_rank")
  if isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or rope_dims < 0:
    raise ValueError(f"rope_dims must be a non-negative integer, got {rope_dims!r}")
  if rope_dims and config.positions != "rope":
    raise ValueError(
      f"rope_dims={rope_dims} asks for rotary dims of a model with positions={config.positions!r}, "
      "which has none; use rope_dims=0"
    )
  if config.positions == "rope" and not rope_dims:
    raise ValueError("rope_dims must be positive for a RoPE model: each kv head keeps at least one frequency pair")
  k, h = config.num_kv_heads, config.head_dim
  if rope_dims % (2 * k):
    raise ValueError(
      f"rope_dims={rope_dims} must be a multiple of 2 x num_kv_heads={2 * k}: each kv head keeps whole frequency pairs"
    )
  if rope_dims // k > h:
    raise ValueError(f"rope_dims={rope_dims} keeps {rope_dims // k} rotary dims per kv head, more than head_dim={h}")
  limit = min(config.d_model, k * (2 * h - rope_dims // k))
  if rank > limit:
    raise ValueError(
      f"kv_latent_rank={rank} is larger than possible: the position-free keys and the values of "
      f"{k} kv heads span at most min(d_model={config.d_model}, {k} x (2 x {h} - {rope_dims // k}))"
      f" = {limit} dims"
    )


def pair_scores(x: np.ndarray, attn: dict, config: ModelConfig) -> np.ndarray:
  """[K, H/2]: each rotary pair's contribution to each kv head's scores, sum over its query heads of
  rms|q_pair| x rms|k_pair| on the inputs x [T, D]."""
  q = pca.complex_pairs(
    pca.project(x, pca.param_leaf(attn, "q", "kernel"), pca.param_leaf(attn, "q", "bias"))
  )  # [T, N, H/2]
  k = pca.complex_pairs(pca.keys_values(x, attn)[0])  # [T, K, H/2]
  rms = lambda z: np.sqrt(np.mean(np.abs(z) ** 2, axis=0))
  reads = kv_head_of(np.arange(config.num_heads), config.num_heads, config.num_kv_heads)
  q_norms = np.stack([rms(q[:, reads == j]).sum(axis=0) for j in range(config.num_kv_heads)])  # [K, H/2]
  return q_norms * rms(k)


def factorise(m: np.ndarray, x: np.ndarray | None, rank: int) -> tuple[np.ndarray, np.ndarray]:
  """m [F, C] ~ a [F, rank] @ b [rank, C]: the truncated SVD of m, or with inputs x [T, F] the
  factorisation minimising ||x (m - a b)||_F."""
  if x is None:
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    return u[:, :rank] * s[:rank], vt[:rank]
  cov = x.T @ x
  cov += (1e-8 * np.trace(cov) / len(cov) + 1e-12) * np.eye(len(cov))  # a direction x never takes
  chol = np.linalg.cholesky(cov)  # cov = L L^T, so ||x e|| = ||L^T e||
  u, s, vt = np.linalg.svd(chol.T @ m, full_matrices=False)
  return np.linalg.solve(chol.T, u[:, :rank] * s[:rank]), vt[:rank]


def convert_layer(
  attn: dict, x: np.ndarray, config: ModelConfig, rank: int, rope_dims: int, factorisation: str
) -> tuple[dict, tuple[int, ...]]:
  """One layer's attention {q, k, v, out} -> (its MLA params as numpy, the kept frequency index
  of each rotary pair, group by group)."""
  n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
  half, kept_pairs = h // 2, rope_dims // (2 * k)
  get = lambda proj, leaf: pca.param_leaf(attn, proj, leaf)
  biased = get("k", "bias") is not None
  scores = pair_scores(x, attn, config) if kept_pairs else np.zeros((k, half))
  rope_order, nope_order, pairs = [], [], []
  for j in range(k):
    kept = np.sort(np.argsort(-scores[j], kind="stable")[:kept_pairs])
    dropped = np.setdiff1d(np.arange(half), kept)
    rope_order.append(np.concatenate([kept, kept + half]))  # rotate-half order within the group
    nope_order.append(np.concatenate([dropped, dropped + half]))
    pairs += kept.tolist()
  reads = kv_head_of(np.arange(n), n, k)
  q_order = np.stack([np.concatenate([nope_order[j], rope_order[j]]) for j in reads])  # [N, H]
  new = {
    "out": {leaf: np.asarray(value) for leaf, value in attn["out"].items()},
    "q": {
      leaf: np.take_along_axis(np.asarray(value, np.float64), q_order if value.ndim == 2 else q_order[None], axis=-1)
      for leaf, value in attn["q"].items()
    },
  }
  if rope_dims:
    new["k_rope"] = {
      leaf: np.concatenate([np.asarray(value, np.float64)[..., j, rope_order[j]] for j in range(k)], axis=-1)
      for leaf, value in attn["k"].items()
    }
  # The position-free keys and the values of every kv head, a bias row below the kernel: [D(+1), K*(E+H)].
  stack = lambda proj, order: np.concatenate(
    [
      np.concatenate([get(proj, "kernel")[:, j, order[j]]] + ([get(proj, "bias")[None, j, order[j]]] if biased else []))
      for j in range(k)
    ],
    axis=1,
  )
  m = np.concatenate([stack("k", nope_order), stack("v", [np.arange(h)] * k)], axis=1)
  inputs = np.concatenate([x, np.ones((len(x), 1))], axis=1) if biased else x
  down, up = factorise(m, inputs if factorisation == "activation" else None, rank)
  new["kv_down"] = {"kernel": down[: config.d_model]} | ({"bias": down[config.d_model]} if biased else {})
  e = h - 2 * kept_pairs
  k_up, v_up = up[:, : k * e].reshape(rank, k, e), up[:, k * e :].reshape(rank, k, h)
  new["k_up"], new["v_up"] = k_up[:, reads], v_up[:, reads]  # [R, N, E], [R, N, H]
  return new, tuple(int(p) for p in pairs)


def convert_to_mla(
  params, config: ModelConfig, rank: int, rope_dims: int, *, calibration, factorisation: str = "activation"
):
  """Converts an MHA / GQA checkpoint to multi-head latent attention.

  Args:
    params: the model's 'params' tree; config: its ModelConfig (RoPE or learned positions).
    rank: the latent rank R (kv_latent_rank), at most min(d_model, K x (2 x head_dim - rope_dims / K)).
    rope_dims: the shared rotary key's width, K groups of whole pairs (0 for learned positions).
    calibration: int[B, T] tokens (e.g. windows of the source's training data) whose attention
      inputs score the frequency pairs and weight the factorisation.
    factorisation: "activation" or "svd" (module docstring).
  Returns:
    (params, config) of the MLA model: KV bytes per token layers x (rank + rope_dims) x dtype.
    The input is not modified.
  """
  check_target(config, rank, rope_dims)
  if factorisation not in FACTORISATIONS:
    raise ValueError(f"factorisation must be one of {FACTORISATIONS}, got {factorisation!r}")
  calibration = check_calibration(calibration, config, "mla")
  for i in range(config.num_layers):
    if f"layers_{i}" not in params:
      raise ValueError(f"params have no 'layers_{i}' but config.num_layers={config.num_layers}")
  new_params, pairs = dict(params), []
  for i, x in enumerate(pca.attention_inputs(params, config, calibration)):
    layer = params[f"layers_{i}"]
    attn, kept = convert_layer(layer["attn"], x, config, rank, rope_dims, factorisation)
    dtype = layer["attn"]["q"]["kernel"].dtype
    to_array = lambda value: jnp.asarray(value, dtype)
    new_params[f"layers_{i}"] = {
      **layer,
      "attn": {
        name: ({leaf: to_array(v) for leaf, v in value.items()} if isinstance(value, dict) else to_array(value))
        for name, value in attn.items()
      },
    }
    pairs.append(kept)
  new_config = config.replace(kv_latent_rank=rank, rope_dims=rope_dims, rope_pairs=tuple(pairs) if rope_dims else None)
  return new_params, new_config
