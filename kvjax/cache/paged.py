"""Paged KV cache (PagedAttention): per-layer page pools addressed through page tables.

Shapes (the alphabet of kvjax.model.attention, plus):
  P pages in the pool, Z page size (tokens per page), M page-table width (pages per sequence).
  pool k, v per layer: [K, P, Z, H] in config.cache_dtype, kv-head major (the layout of JAX's
    Pallas paged-attention kernels, so the fast path reads the pool without a copy).
  page_table int32[B, M]: entry j of row b is the page holding positions [j*Z, (j+1)*Z).
  lengths int32[B]: tokens cached per row.

Page 0 is the null page. No sequence owns it; unused page-table entries point at it, and the
writes of padding positions and idle batch rows land in it. Nothing read from it is ever used:
every read is masked to the row's valid positions.

This module is the device side (pool, jitted prefill / decode / page copies); which pages a
sequence owns is decided on the host by kvjax.serving.allocator. The paged functions run kvjax's own
Transformer and params: they bind the model and call its embedding, blocks' norms, MLP,
Attention.project, `attend` and Attention.out, replacing only where K/V are stored and read.
"""

from __future__ import annotations

import functools
import statistics
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.attention import attend
from kvjax.config import ModelConfig
from kvjax.decoding.decode import _decode_step as _decode_step_contiguous
from kvjax.decoding.decode import check_prompts, check_step_tokens
from kvjax.model.transformer import Transformer, causal_mask

NULL_PAGE = 0
ATTENTION_IMPLS = ("gather", "pallas", "pallas_interpret")


@flax.struct.dataclass
class PagedCache:
  """Page pools (one k and one v per layer), page table and lengths. Plain data, replaced each step."""

  k: tuple[jax.Array, ...]  # per layer [K, P, Z, H]
  v: tuple[jax.Array, ...]
  page_table: jax.Array  # int32[B, M]
  lengths: jax.Array  # int32[B]

  @property
  def num_pages(self) -> int:
    return self.k[0].shape[1]

  @property
  def page_size(self) -> int:
    return self.k[0].shape[2]

  @property
  def max_pages(self) -> int:
    return self.page_table.shape[1]

  @property
  def pool_bytes(self) -> int:
    return sum(x.nbytes for x in self.k + self.v)


def init_cache(config: ModelConfig, num_pages: int, page_size: int, batch: int, max_pages: int) -> PagedCache:
  """Allocates the pools once, zeroed: num_pages pages (page 0 is the null page) of page_size tokens."""
  for name, value in (("num_pages", num_pages), ("page_size", page_size), ("batch", batch),
                      ("max_pages", max_pages)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
  if num_pages < 2:
    raise ValueError(f"num_pages={num_pages} leaves no page besides the reserved null page")
  shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
  pools = lambda: tuple(jnp.zeros(shape, config.kv_dtype) for _ in range(config.num_layers))
  return PagedCache(k=pools(), v=pools(), page_table=jnp.zeros((batch, max_pages), jnp.int32),
                    lengths=jnp.zeros((batch,), jnp.int32))


def gather(pool: jax.Array, page_table: jax.Array) -> jax.Array:
  """pool [K, P, Z, H], page_table int[B, M] -> [B, K, M*Z, H], each row's pages in sequence order
  (the kv-head-major layout `attend` reads)."""
  num_kv_heads, _, page_size, head_dim = pool.shape
  batch, width = page_table.shape
  pages = pool[:, page_table]  # [K, B, M, Z, H]
  return jnp.swapaxes(pages, 0, 1).reshape(batch, num_kv_heads, width * page_size, head_dim)


def paged_attend(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                 mask: jax.Array) -> jax.Array:
  """`attend` over each row's pages. q [B, T, N, H], pools [K, P, Z, H], page_table [B, M],
  mask bool [B, T, M*Z] -> [B, T, N, H]."""
  return attend(q, gather(k_pool, page_table), gather(v_pool, page_table), mask)


def _write(pool: jax.Array, new: jax.Array, pages: jax.Array, slots: jax.Array) -> jax.Array:
  """Stores new [B, K, T, H] at (pages[b, t], slots[b, t]) of pool [K, P, Z, H]."""
  return pool.at[:, pages, slots].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype))  # [K, B, T, H]


def _locate(page_table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int):
  """Page and in-page slot of positions int[B, T]; invalid positions go to the null page."""
  pages = jnp.take_along_axis(page_table, positions // page_size, axis=1)
  return jnp.where(valid, pages, NULL_PAGE), positions % page_size


def _pallas_kernel():
  """JAX's Pallas GPU paged-attention kernel, or None where this JAX does not ship it."""
  try:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
  except ImportError:
    return None
  return paged_attention


def pallas_available() -> bool:
  """True when JAX's Pallas paged-attention kernel is importable and a GPU backend is present."""
  return jax.default_backend() == "gpu" and _pallas_kernel() is not None


def _pallas_attend(q, k_pool, v_pool, page_table, lengths, interpret: bool):
  """The Pallas kernel on one query per row: q [B, 1, N, H], lengths = positions to read -> [B, 1, N, H].
  The kernel does not scale scores and computes in the pool's dtype."""
  width = page_table.shape[1]
  k_splits = max(d for d in range(1, min(16, width) + 1) if width % d == 0)
  per_split = width // k_splits
  per_block = max(d for d in range(1, min(8, per_split) + 1) if per_split % d == 0)
  scaled = (q[:, 0] * q.shape[-1] ** -0.5).astype(k_pool.dtype)  # [B, N, H]
  out = _pallas_kernel()(scaled, k_pool, v_pool, page_table, lengths, k_splits=k_splits,
                         pages_per_compute_block=per_block, interpret=interpret)
  return out.astype(q.dtype)[:, None]


def _layers(module: Transformer, tokens, positions, attention):
  """The Transformer's forward with attention supplied per layer: attention(i, attn, h) -> [B, T, D]."""
  x = module._embed(tokens, positions)
  for i, layer in enumerate(module.layers):
    x = layer._finish(x, attention(i, layer.attn, layer.attn_norm(x)))
  return module._logits(x)


def prefill_logits(model: Transformer, params, cache: PagedCache, tokens, lengths):
  """Traced body of `prefill`; for callers that compose it inside their own jit."""
  def run(module, cache, tokens, lengths):
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    mask = causal_mask(lengths, seq)
    pages, slots = _locate(cache.page_table, positions, positions < lengths[:, None], cache.page_size)
    k_pools, v_pools = list(cache.k), list(cache.v)

    def attention(i, attn, h):
      q, k, v = attn.project(h, positions)
      k_pools[i] = _write(k_pools[i], k, pages, slots)
      v_pools[i] = _write(v_pools[i], v, pages, slots)
      return attn.out(attend(q, k, v, mask))

    logits = _layers(module, tokens, positions, attention)
    return logits, cache.replace(k=tuple(k_pools), v=tuple(v_pools), lengths=lengths.astype(jnp.int32))
  return model.apply({"params": params}, cache, tokens, lengths, method=run)


def decode_logits(model: Transformer, params, cache: PagedCache, tokens, impl: str = "gather"):
  """Traced body of `decode_step`; for callers that compose it inside their own jit."""
  def run(module, cache, tokens):
    lengths = cache.lengths
    positions = lengths[:, None]  # [B, 1]
    pages, slots = _locate(cache.page_table, positions, True, cache.page_size)
    span = cache.max_pages * cache.page_size
    mask = (jnp.arange(span)[None, :] <= lengths[:, None])[:, None, :]  # [B, 1, S]
    k_pools, v_pools = list(cache.k), list(cache.v)

    def attention(i, attn, h):
      q, k, v = attn.project(h, positions)
      k_pools[i] = _write(k_pools[i], k, pages, slots)
      v_pools[i] = _write(v_pools[i], v, pages, slots)
      if impl == "gather":
        out = paged_attend(q, k_pools[i], v_pools[i], cache.page_table, mask)
      else:
        out = _pallas_attend(q, k_pools[i], v_pools[i], cache.page_table, lengths + 1,
                             interpret=impl == "pallas_interpret")
      return attn.out(out)

    logits = _layers(module, tokens[:, None], positions, attention)[:, 0]
    return logits, cache.replace(k=tuple(k_pools), v=tuple(v_pools), lengths=lengths + 1)
  return model.apply({"params": params}, cache, tokens, method=run)


_prefill = jax.jit(prefill_logits, static_argnames=("model",), donate_argnames=("cache",))
_decode = jax.jit(decode_logits, static_argnames=("model", "impl"), donate_argnames=("cache",))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_pages(cache: PagedCache, src: jax.Array, dst: jax.Array) -> PagedCache:
  copy = lambda pool: pool.at[:, dst].set(pool[:, src])
  return cache.replace(k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)))


def check_page_table(cache: PagedCache, page_table, needed) -> np.ndarray:
  """Validates page_table int[B, M] against the pool: every row owns a real page for each of its
  first needed[b] positions. Returns it as int32 numpy. Gathers clamp out-of-range indices, so a bad
  table must never reach the device."""
  table = np.asarray(page_table)
  needed = np.asarray(needed)
  if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
    raise ValueError(f"page_table must be an integer array [batch, max_pages], got {table.dtype}{list(table.shape)}")
  if table.shape[0] != needed.shape[0]:
    raise ValueError(f"page_table has {table.shape[0]} rows but the batch has {needed.shape[0]}")
  if ((table < 0) | (table >= cache.num_pages)).any():
    row, col = map(int, np.argwhere((table < 0) | (table >= cache.num_pages))[0])
    raise ValueError(f"page_table[{row}, {col}]={int(table[row, col])} is outside the pool's "
                     f"[0, {cache.num_pages}) pages")
  capacity = table.shape[1] * cache.page_size
  if (needed > capacity).any():
    row = int(np.argmax(needed))
    raise ValueError(f"row {row} needs {int(needed[row])} positions but the page table holds "
                     f"{table.shape[1]} pages of {cache.page_size} = {capacity}")
  used = np.arange(table.shape[1])[None, :] < -(-needed[:, None] // cache.page_size)
  if (used & (table == NULL_PAGE)).any():
    row, col = map(int, np.argwhere(used & (table == NULL_PAGE))[0])
    raise ValueError(f"row {row} has no page for positions [{col * cache.page_size}, "
                     f"{(col + 1) * cache.page_size}): page_table[{row}, {col}] is the null page")
  return table.astype(np.int32)


def prefill(model: Transformer, params, cache: PagedCache, tokens, lengths, page_table):
  """Writes right-padded prompts into their pages and returns their logits.

  Args:
    cache: pools to write into (donated); its page_table and lengths are replaced.
    tokens: int[B, T], row b holds its prompt in [0, lengths[b]).
    lengths: int[B], each in [1, T].
    page_table: int[B, M], owning a page for every prompt position.
  Returns:
    (logits float32[B, T, V], cache with page_table and lengths set).
  """
  tokens, lengths = check_prompts(model, tokens, lengths, model.config.max_len)
  table = check_page_table(cache, page_table, lengths)
  cache = cache.replace(page_table=jnp.asarray(table))
  return _prefill(model, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))


def decode_step(model: Transformer, params, cache: PagedCache, tokens, impl: str = "gather"):
  """Feeds one token per row at position cache.lengths[b] -> (logits float32[B, V], new cache).

  impl: "gather" (pure jnp, any backend), "pallas" (JAX's Pallas GPU kernel; see
  `pallas_available`) or "pallas_interpret" (the same kernel interpreted, for checking on CPU).
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  if impl == "pallas" and not pallas_available():
    raise ValueError(f"impl='pallas' needs a GPU backend and JAX's Pallas paged-attention kernel; "
                     f"the backend is {jax.default_backend()!r}")
  if impl == "pallas_interpret" and _pallas_kernel() is None:
    raise ValueError("impl='pallas_interpret' needs JAX's Pallas paged-attention kernel, which this JAX lacks")
  lengths = np.asarray(cache.lengths)
  tokens = check_step_tokens(model, tokens, lengths)
  table = check_page_table(cache, cache.page_table, lengths + 1)
  cache = cache.replace(page_table=jnp.asarray(table), lengths=jnp.asarray(lengths, jnp.int32))
  return _decode(model, params, cache, jnp.asarray(tokens, jnp.int32), impl)


def copy_pages(cache: PagedCache, src, dst) -> PagedCache:
  """Copies pages src[i] -> dst[i] in every pool (copy-on-write after a fork). src, dst int[C]."""
  src, dst = np.asarray(src, np.int32).reshape(-1), np.asarray(dst, np.int32).reshape(-1)
  if src.shape != dst.shape:
    raise ValueError(f"copy_pages needs as many sources as destinations, got {src.size} and {dst.size}")
  if src.size == 0:
    return cache
  if ((np.concatenate([src, dst]) <= NULL_PAGE) | (np.concatenate([src, dst]) >= cache.num_pages)).any():
    raise ValueError(f"copy_pages indices must be real pages in [1, {cache.num_pages}), got {src} -> {dst}")
  return _copy_pages(cache, jnp.asarray(src), jnp.asarray(dst))


def bench_paged(args) -> dict:
  """`kvjax bench paged`: the paged decode step vs the contiguous one at equal batch and context.

  Both caches hold the same K/V (the contiguous cache's rows scattered over randomly ordered
  pages), so the first step's logits are compared too. Steps alternate between the two so that
  both see the same machine load. Reads args.set, args.batch, args.repeats and, when given,
  args.context (default 1024) and args.page_size (default 16).
  """
  from kvjax.bench import benchmarks as bench
  from kvjax.config import apply_overrides

  cfg = apply_overrides(bench.BENCH_MODEL, [s.removeprefix("model.") for s in args.set])
  batch, context = args.batch, getattr(args, "context", 1024)
  page_size = getattr(args, "page_size", 16)
  impls = ["gather", "pallas"] if pallas_available() else ["gather"]
  steps = max(4 * args.repeats, 8)
  advance = (1 + len(impls)) * (steps + 1)  # every timed step writes one more position
  if context % page_size or context > cfg.max_len or context <= advance:
    raise ValueError(f"context={context} must be a multiple of page_size={page_size}, at most "
                     f"ModelConfig.max_len={cfg.max_len} and more than {advance} (the timed steps)")
  model, params = bench.init_model(cfg)
  start = context - advance
  contiguous = bench.filled_cache(model, params, batch, start, context)
  width = context // page_size
  table = np.random.default_rng(0).permutation(np.arange(1, batch * width + 1)).reshape(batch, width)
  cache = init_cache(cfg, batch * width + 1, page_size, batch, width)

  def scatter(pool, rows):  # rows [B, K, S, H] -> pool [K, P, Z, H] pages in table order
    pages = rows.reshape(batch, cfg.num_kv_heads, width, page_size, cfg.head_dim).swapaxes(0, 1)
    return pool.at[:, table].set(pages.astype(pool.dtype))

  layers = [contiguous[f"layers_{i}"]["attn"] for i in range(cfg.num_layers)]
  caches = {"contiguous": contiguous}
  for impl in impls:
    caches[impl] = cache.replace(k=tuple(scatter(p, l["k"].swapaxes(2, 3)) for p, l in zip(cache.k, layers)),
                                 v=tuple(scatter(p, l["v"]) for p, l in zip(cache.v, layers)),
                                 page_table=jnp.asarray(table, jnp.int32),
                                 lengths=jnp.full((batch,), start, jnp.int32))
  del layers, contiguous, cache
  tokens = jnp.zeros((batch,), jnp.int32)

  def step(name):
    if name == "contiguous":
      logits, caches[name] = _decode_step_contiguous(model, params, caches[name], tokens)
    else:
      logits, caches[name] = _decode(model, params, caches[name], tokens, name)
    return logits.block_until_ready()

  first = {name: step(name) for name in caches}  # compiles; same K/V, so the same logits
  wall = {name: [] for name in caches}
  cpu = {name: [] for name in caches}
  for i in range(steps):
    for name in sorted(caches, reverse=i % 2 == 1):  # alternate which goes first
      begin_wall, begin_cpu = time.perf_counter(), time.process_time()
      step(name)
      wall[name].append(time.perf_counter() - begin_wall)
      cpu[name].append(time.process_time() - begin_cpu)
  ms = {name: statistics.median(t) * 1e3 for name, t in wall.items()}
  cpu_ms = {name: statistics.median(t) * 1e3 for name, t in cpu.items()}
  result = {"benchmark": "paged", "backend": jax.default_backend(), "model": cfg.to_dict(), "batch": batch,
            "context": context, "page_size": page_size, "steps": steps,
            "contiguous_step_ms": ms["contiguous"], "paged_step_ms": ms["gather"],
            "paged_over_contiguous": ms["gather"] / ms["contiguous"],
            "cpu_time_paged_over_contiguous": cpu_ms["gather"] / cpu_ms["contiguous"],
            "first_step_max_logit_diff": float(jnp.abs(first["gather"] - first["contiguous"]).max()),
            "pallas_available": pallas_available()}
  if "pallas" in caches:
    result.update(pallas_step_ms=ms["pallas"], pallas_over_contiguous=ms["pallas"] / ms["contiguous"],
                  pallas_first_step_max_logit_diff=float(jnp.abs(first["pallas"] - first["contiguous"]).max()))
  return result
