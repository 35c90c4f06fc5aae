"""Data-aware kv-head conversion: merge each group's K and V heads into one by PCA over
calibration tokens, folding what the merge loses in basis into the query and output projections.

For a group of G old kv heads read by their query heads, the new kv head is a linear map of the
old ones, chosen so that every old head is (approximately) recovered from it by a head-specific
linear map M_j; M_j is then folded into the projections that consume head j:
  values:  v_j ~ v_new @ P_j^T with P [G*H, H] the top-H principal directions of the group's
           stacked values [v_1 .. v_G] (uncentered: the map stays linear, biases included).
           Head n's output rows become P_j^T @ W_out[n].
  keys, learned positions: the same PCA; k_j ~ k_new @ P_j^T, so q_n . k_j = (q_n @ P_j) . k_new
           and head n's query projection becomes W_q[n] @ P_j.
  keys, RoPE: a map must commute with the rotation, so it acts on each frequency pair (dims p
           and p + H/2, rotate-half convention) as one complex number. Per pair, the group's keys
           z_j are mixed as z_new = sum_j u_j z_j with u the top eigenvector of the G x G
           Hermitian covariance Z^H Z, and z_j ~ conj(u_j) z_new; q . k is Re sum_p q_p conj(k_p),
           so each query head's pair is multiplied by u_j.
Exact (logits unchanged) when a group's heads are such transforms of one another: the stacked
values have rank H, the keys of each pair are complex multiples of one another. Mean-pooling is
the special case u_j = 1/sqrt(G) (up to scale), P_j = I/sqrt(G).
Calibration inputs are the source model's attention inputs (after attn_norm) on the calibration
tokens; covariances are accumulated in float64.
"""

from __future__ import annotations

import jax
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model.keys import kv_head_of
from kvjax.model.transformer import Transformer


def attention_inputs(params, config: ModelConfig, tokens: np.ndarray) -> list[np.ndarray]:
  """Each layer's attention input (the output of its attn_norm) on `tokens` int[B, T] -> [B*T, D] float64."""
  is_attn_norm = lambda module, method: module.name == "attn_norm" and method == "__call__"
  _, state = Transformer(config).apply(
    {"params": params}, jax.numpy.asarray(tokens), capture_intermediates=is_attn_norm, mutable=["intermediates"]
  )
  captured = state["intermediates"]
  return [
    np.asarray(captured[f"layers_{i}"]["attn_norm"]["__call__"][0], np.float64).reshape(-1, config.d_model)
    for i in range(config.num_layers)
  ]


def project(x, kernel, bias):
  """x [T, D], kernel [D, K, H], bias [K, H] or None -> [T, K, H]."""
  out = np.einsum("td,dkh->tkh", x, kernel)
  return out if bias is None else out + bias


def param_leaf(attn: dict, proj: str, leaf: str) -> np.ndarray | None:
  """attn[proj][leaf] as float64 numpy, or None when the layer has no such leaf (no bias)."""
  return None if leaf not in attn[proj] else np.asarray(attn[proj][leaf], np.float64)


def keys_values(x: np.ndarray, attn: dict) -> tuple[np.ndarray, np.ndarray]:
  """The layer's keys and values (before RoPE) on its inputs x [T, D] -> two [T, K, H]."""
  return tuple(project(x, param_leaf(attn, proj, "kernel"), param_leaf(attn, proj, "bias")) for proj in ("k", "v"))


def complex_pairs(a: np.ndarray) -> np.ndarray:
  """[..., H] real (rotate-half pairs p, p + H/2) -> [..., H/2] complex."""
  half = a.shape[-1] // 2
  return a[..., :half] + 1j * a[..., half:]


def _unpairs(z: np.ndarray) -> np.ndarray:
  return np.concatenate([z.real, z.imag], axis=-1)


def _top_subspace(stacked: np.ndarray, rank: int) -> np.ndarray:
  """stacked [T, F] -> the top-`rank` eigenvectors of stacked^T stacked, [F, rank]."""
  _, vectors = np.linalg.eigh(stacked.T @ stacked)
  return vectors[:, ::-1][:, :rank]


def convert_layer(attn: dict, x: np.ndarray, config: ModelConfig, num_kv_heads: int) -> dict:
  """One layer's attention params {q, k, v, out: {kernel, bias?}} converted to num_kv_heads by PCA
  over its inputs x [T, D]. Returns new numpy param dicts."""
  old_kv, n, h = config.num_kv_heads, config.num_heads, config.head_dim
  size = old_kv // num_kv_heads  # old kv heads per new one
  get = lambda proj, leaf: param_leaf(attn, proj, leaf)
  q_w, q_b, k_w, k_b = get("q", "kernel"), get("q", "bias"), get("k", "kernel"), get("k", "bias")
  v_w, v_b, out_w = get("v", "kernel"), get("v", "bias"), get("out", "kernel")
  reads = kv_head_of(np.arange(n), n, old_kv)  # the old kv head each query head reads
  keys, values = keys_values(x, attn)  # [T, K_old, H]
  new_k_w = np.zeros((config.d_model, num_kv_heads, h))
  new_v_w = np.zeros_like(new_k_w)
  new_k_b = None if k_b is None else np.zeros((num_kv_heads, h))
  new_v_b = None if v_b is None else np.zeros((num_kv_heads, h))
  q_w, out_w = q_w.copy(), out_w.copy()
  q_b = None if q_b is None else q_b.copy()
  for g in range(num_kv_heads):
    heads = np.arange(g * size, (g + 1) * size)
    # Values: top-H principal directions of the stacked [v_1 .. v_G].
    basis = _top_subspace(values[:, heads].reshape(len(x), size * h), h).reshape(size, h, h)  # P_j [H, H]
    new_v_w[:, g] = np.einsum("djh,jhe->de", v_w[:, heads], basis)
    if v_b is not None:
      new_v_b[g] = np.einsum("jh,jhe->e", v_b[heads], basis)
    for j, head in enumerate(heads):
      for query in np.flatnonzero(reads == head):
        out_w[query] = basis[j].T @ out_w[query]
    # Keys: per RoPE pair a complex mix, or a PCA like the values for learned positions.
    if config.positions == "rope":
      z = complex_pairs(keys[:, heads])  # [T, G, H/2]
      cov = np.einsum("tgp,tjp->pgj", z.conj(), z)  # [H/2, G, G], Hermitian per pair
      weights = np.linalg.eigh(cov)[1][:, :, -1]  # [H/2, G]: the top eigenvector of each pair
      mix = lambda a: _unpairs(np.einsum("...jp,pj->...p", complex_pairs(a), weights))
      new_k_w[:, g] = mix(k_w[:, heads])
      if k_b is not None:
        new_k_b[g] = mix(k_b[heads][None])[0]
      for j, head in enumerate(heads):
        for query in np.flatnonzero(reads == head):
          q_w[:, query] = _unpairs(complex_pairs(q_w[:, query]) * weights[:, j])
          if q_b is not None:
            q_b[query] = _unpairs(complex_pairs(q_b[query]) * weights[:, j])
    else:
      basis = _top_subspace(keys[:, heads].reshape(len(x), size * h), h).reshape(size, h, h)
      new_k_w[:, g] = np.einsum("djh,jhe->de", k_w[:, heads], basis)
      if k_b is not None:
        new_k_b[g] = np.einsum("jh,jhe->e", k_b[heads], basis)
      for j, head in enumerate(heads):
        for query in np.flatnonzero(reads == head):
          q_w[:, query] = q_w[:, query] @ basis[j]
          if q_b is not None:
            q_b[query] = q_b[query] @ basis[j]
  new = {name: dict(attn[name]) for name in attn}
  new["q"]["kernel"], new["k"]["kernel"], new["v"]["kernel"], new["out"]["kernel"] = q_w, new_k_w, new_v_w, out_w
  for name, bias in (("q", q_b), ("k", new_k_b), ("v", new_v_b)):
    if bias is not None:
      new[name]["bias"] = bias
  return new


def _pair_scores(x: np.ndarray, attn: dict, config: ModelConfig) -> np.ndarray:
  """[K, K]: how well each pair of kv heads merges into one, as the fraction of their energy a
  merged head keeps (keys: per RoPE pair, or as a subspace for learned positions; values: the top-H
  subspace of the stacked pair), keys and values added."""
  keys, values = keys_values(x, attn)
  k, h = config.num_kv_heads, config.head_dim

  def kept(stacked, rank):
    eig = np.linalg.eigvalsh(stacked.T @ stacked)
    return eig[::-1][:rank].sum() / max(eig.sum(), 1e-30)

  scores = np.zeros((k, k))
  for i in range(k):
    for j in range(i + 1, k):
      if config.positions == "rope":
        z = complex_pairs(keys[:, [i, j]])  # [T, 2, H/2]
        cov = np.einsum("tgp,tjp->pgj", z.conj(), z)
        eig = np.linalg.eigvalsh(cov)  # [H/2, 2]
        key_score = eig[:, -1].sum() / max(eig.sum(), 1e-30)
      else:
        key_score = kept(keys[:, [i, j]].reshape(len(x), 2 * h), h)
      scores[i, j] = scores[j, i] = key_score + kept(values[:, [i, j]].reshape(len(x), 2 * h), h)
  return scores


def regroup_order(x: np.ndarray, attn: dict, config: ModelConfig, num_kv_heads: int) -> np.ndarray:
  """An order of the old kv heads whose contiguous blocks of K_old / K_new heads merge well:
  greedily, each block starts at the first head not yet placed and takes the heads that score
  best with its members (`_pair_scores`)."""
  size = config.num_kv_heads // num_kv_heads
  scores = _pair_scores(x, attn, config)
  left, order = list(range(config.num_kv_heads)), []
  while left:
    block = [left.pop(0)]
    while len(block) < size:
      best = max(left, key=lambda j: scores[block, j].mean())
      left.remove(best)
      block.append(best)
    order += block
  return np.asarray(order)


def permute_heads(attn: dict, config: ModelConfig, order: np.ndarray) -> dict:
  """One layer's attention with its kv heads in `order` (new head i is old head order[i]) and each
  kv head's query heads and output rows moved along: the same function, since attention sums over
  heads and each query head keeps reading its kv head."""
  per_kv = config.num_heads // config.num_kv_heads
  queries = (order[:, None] * per_kv + np.arange(per_kv)).reshape(-1)
  take = {"q": queries, "k": order, "v": order, "out": queries}
  new = {name: dict(attn[name]) for name in attn}
  for name, index in take.items():
    for leaf, value in attn[name].items():
      if name == "out" and leaf == "bias":
        continue  # [D]: summed over heads already
      axis = (
        0 if name == "out" or leaf == "bias" else 1
      )  # out kernel [N, H, D], biases [heads, H], kernels [D, heads, H]
      new[name][leaf] = np.take(np.asarray(value), index, axis=axis)
  return new
