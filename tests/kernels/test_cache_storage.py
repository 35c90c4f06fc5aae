"""The CPU decode-attention kernel over each cache storage, named by its route (contiguous or
paged, float32 or int8), against XLA's computation on the same values, its routing, its gradients
and its input checks."""

import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvjax.cache.codec import codec
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.contiguous import ContiguousCache, attend_one
from kvjax.cache.layouts.paged import PagedCache, attend_pages
from kvjax.config import ModelConfig
from kvjax.decoding.decode import for_decoding, forward
from kvjax.kernels import attention as attention_kernel
from kvjax.model.backend import XLA as XLA_BACKEND
from kvjax.model.transformer import Transformer

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or shutil.which("g++") is None and shutil.which("c++") is None,
  reason="the kernel is built for the CPU with the system's C++ compiler",
)


# (paged, int8) -> the route the cache kind names its storage by, and the XLA computation it hands
# the kernel as its reference (the codec decodes an int8 storage with its scales).
ROUTES = {
  (paged, int8): ("paged" if paged else "contiguous", "int8" if int8 else "float32")
  for paged in (False, True)
  for int8 in (False, True)
}
XLA = {
  key: functools.partial(attend_pages if route[0] == "paged" else attend_one, codec=codec(route[1]))
  for key, route in ROUTES.items()
}
FLOAT = functools.partial(attend_one, codec=codec("float32"))  # the contiguous float32 reference


def storage(batch, kv_heads, groups, head_dim, page_size, pages, lengths, paged, int8, seed=0):
  """q, k, v, lengths and the addressing of one cache storage, and the dequantized contiguous
  k [B, K, H, S], v [B, K, S, H] it holds. Paged: the rows' pages shuffled over the pool, table
  entries past a row's pages on the null page 0, which (like every unused page) holds NaN (int8:
  NaN scales), so a read of it would show."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths, np.int32)
  s = page_size * pages
  q = rng.standard_normal((batch, 1, kv_heads * groups, head_dim), np.float32)
  if int8:
    k = rng.integers(-127, 128, (batch, kv_heads, head_dim, s), dtype=np.int8)
    v = rng.integers(-127, 128, (batch, kv_heads, s, head_dim), dtype=np.int8)
    k_scale, v_scale = (rng.uniform(0.001, 0.03, (batch, kv_heads, s)).astype(np.float32) for _ in range(2))
    k_float, v_float = k * k_scale[:, :, None, :], v * v_scale[..., None]
  else:
    k = rng.standard_normal((batch, kv_heads, head_dim, s), np.float32)
    v = rng.standard_normal((batch, kv_heads, s, head_dim), np.float32)
    k_float, v_float = k, v
  addressing = {"k_scale": k_scale, "v_scale": v_scale} if int8 else {}
  if not paged:
    return q, k, v, lengths, addressing, (k_float, v_float)

  table = rng.permutation(np.arange(1, batch * pages + 1)).reshape(batch, pages).astype(np.int32)
  used = np.arange(pages)[None, :] < -(-(lengths[:, None] + 1) // page_size)

  # rows [B, K, S, ...] -> pool [K, P, Z, ...], pages in table order; the unused pages hold `fill`
  def paginate(rows, fill):
    pool = np.full((kv_heads, batch * pages + 1, page_size, *rows.shape[3:]), fill, rows.dtype)
    pool[:, table] = rows.reshape(batch, kv_heads, pages, page_size, *rows.shape[3:]).swapaxes(0, 1)
    pool[:, table[~used]] = fill
    return pool

  data_fill = 127 if int8 else np.nan
  pools = paginate(k.swapaxes(2, 3), data_fill), paginate(v, data_fill)
  if int8:
    addressing = {"k_scale": paginate(k_scale, np.nan), "v_scale": paginate(v_scale, np.nan)}
  addressing["page_table"] = np.where(used, table, 0).astype(np.int32)
  return q, *pools, lengths, addressing, (k_float, v_float)


VARIANTS = [(False, False), (False, True), (True, False), (True, True)]
IDS = ["contiguous", "contiguous-int8", "paged", "paged-int8"]


@pytest.mark.parametrize("paged,int8", VARIANTS, ids=IDS)
@pytest.mark.parametrize(
  "batch,kv_heads,groups,head_dim,page_size,pages,lengths",
  [
    (4, 2, 4, 64, 16, 4, [0, 15, 63, 40]),  # GQA-4: one position, one full page, every page, ragged
    (3, 3, 1, 12, 5, 7, [4, 34, 17]),  # MHA, odd head dim and page size: full pages and a partial one
    (2, 1, 8, 32, 16, 40, [639, 300]),  # GQA-8 over 640 positions: chunks merged
  ],
)
def test_kernel_matches_xla(paged, int8, batch, kv_heads, groups, head_dim, page_size, pages, lengths):
  q, k, v, lengths, addressing, (k_float, v_float) = storage(
    batch, kv_heads, groups, head_dim, page_size, pages, lengths, paged, int8
  )
  xla, route = XLA[paged, int8], ROUTES[paged, int8]
  kernel = jax.jit(lambda *a, **kw: attention_kernel.cache_attention(route, *a, xla, **kw))
  assert attention_kernel.TARGETS[route] in kernel.lower(q, k, v, lengths, **addressing).as_text()
  out = np.asarray(kernel(q, k, v, lengths, **addressing))
  assert np.isfinite(out).all()  # nothing read from the NaN pages
  # XLA on the contiguous dequantized values: the same attention.
  np.testing.assert_allclose(out, FLOAT(q, k_float, v_float, lengths), rtol=1e-5, atol=2e-6)
  if paged or int8:  # and XLA's own computation on the storage (for paged, without the NaN pages' rows)
    clean = (
      {**addressing, "page_table": np.where(addressing["page_table"] == 0, 1, addressing["page_table"])}
      if paged
      else addressing
    )
    expected = xla(
      q,
      np.nan_to_num(k) if not int8 else k,
      np.nan_to_num(v) if not int8 else v,
      lengths,
      **{n: np.nan_to_num(a) for n, a in clean.items()},
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


@settings(max_examples=8, deadline=None)
@given(
  variant=st.sampled_from(VARIANTS),
  batch=st.integers(1, 3),
  kv_heads=st.integers(1, 2),
  groups=st.integers(1, 10),
  head_dim=st.integers(1, 80),
  page_size=st.integers(1, 20),
  pages=st.integers(1, 12),
  data=st.data(),
)
def test_kernel_matches_xla_any_shape(variant, batch, kv_heads, groups, head_dim, page_size, pages, data):
  lengths = data.draw(st.lists(st.integers(0, page_size * pages - 1), min_size=batch, max_size=batch))
  q, k, v, lengths, addressing, (k_float, v_float) = storage(
    batch, kv_heads, groups, head_dim, page_size, pages, lengths, *variant
  )
  out = attention_kernel.cache_attention(ROUTES[variant], q, k, v, lengths, XLA[variant], **addressing)
  np.testing.assert_allclose(out, FLOAT(q, k_float, v_float, lengths), rtol=1e-5, atol=2e-6)


def test_storage_unlike_its_route_stays_with_xla():
  q, k, v, lengths, addressing, _ = storage(2, 1, 2, 8, 4, 2, [3, 7], paged=True, int8=False)
  k, v = np.nan_to_num(k), np.nan_to_num(v)

  def lowered(route, *a, **kw):
    xla = functools.partial(attend_pages, codec=codec(route[1]))
    return jax.jit(lambda *a, **kw: attention_kernel.cache_attention(route, *a, xla, **kw)).lower(*a, **kw).as_text()

  k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  bits = [jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (k16, v16)]  # how the codec stores bfloat16
  assert "kvjax_paged_attention_bf16" in lowered(("paged", "bfloat16"), q, *bits, lengths, **addressing)
  assert "kvjax_paged_attention" not in lowered(("paged", "bfloat16"), q, k16, v16, lengths, **addressing)
  assert "kvjax_paged_attention" not in lowered(("paged", "float16"), q, k16, v16, lengths, **addressing)
  assert "kvjax_paged_attention" not in lowered(("paged", "float32"), q, k16, v16, lengths, **addressing)
  assert "kvjax_paged_attention" in lowered(("paged", "float32"), q, k, v, lengths, **addressing)


@pytest.mark.parametrize(
  "paged,int8", [(True, False), (True, True), (False, True)], ids=["paged", "paged-int8", "int8"]
)
def test_gradients_are_xla(paged, int8):
  q, k, v, lengths, addressing, _ = storage(2, 2, 2, 8, 4, 3, [3, 11], paged, int8)
  k, v = np.nan_to_num(k), np.nan_to_num(v)
  addressing = {n: np.nan_to_num(a) for n, a in addressing.items()}
  if paged:
    addressing["page_table"] = np.where(addressing["page_table"] == 0, 1, addressing["page_table"]).astype(np.int32)
  xla, route = XLA[paged, int8], ROUTES[paged, int8]
  floats = (0,) if int8 else (0, 1, 2)  # the int8 data has no gradient
  ours = jax.grad(
    lambda *a: (attention_kernel.cache_attention(route, *a, lengths, xla, **addressing) ** 2).sum(), floats
  )
  theirs = jax.grad(lambda *a: (xla(*a, lengths, **addressing) ** 2).sum(), floats)
  for a, b in zip(ours(q, k, v), theirs(q, k, v)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_other_layouts_stay_with_xla():
  # A route goes to the kernel only with the storage it names; other scales (int4's grouped ones
  # under the int8 route), addressing (another keyword) or routes are XLA's business.
  q, k, v, lengths, addressing, _ = storage(2, 1, 2, 8, 4, 2, [3, 7], paged=True, int8=True)
  route = ("paged", "int8")
  grouped = {**addressing, "k_scale": np.repeat(addressing["k_scale"][..., None], 2, -1)}
  assert attention_kernel.kernel_target(route, q, k, v, addressing) == "kvjax_paged_attention_int8"
  assert attention_kernel.kernel_target(route, q, k, v, grouped) is None
  assert attention_kernel.kernel_target(route, q, k, v, {**addressing, "window": np.zeros(2)}) is None
  assert attention_kernel.kernel_target(route, q, k, v, {"page_table": addressing["page_table"]}) is None  # no scales
  for other in (("paged", "int4"), ("paged", "float8_e4m3fn"), ("paged", "float32"), ("contiguous", "int8")):
    assert attention_kernel.kernel_target(other, q, k, v, addressing) is None, other
  assert set(ROUTES.values()) < set(attention_kernel.TARGETS)


@pytest.mark.parametrize(
  "fmt,target",
  [
    ("float32", "kvjax_decode_attention"),
    ("int8", "kvjax_decode_attention_int8"),
    ("int4", "kvjax_decode_attention_int4"),
    ("float8_e4m3fn", "kvjax_decode_attention_fp8"),
    ("bfloat16", "kvjax_decode_attention_bf16"),
  ],
)
def test_decode_step_of_each_cache_format_routes_to_its_target(fmt, target):
  """The lowered decode step (kvjax.decoding.decode.forward with the CPU backend) of a contiguous
  cache of CacheConfig(dtype=fmt) on a float32 model calls the kernel's target for its route (the
  int8 cache's k_scale, v_scale [B, K, S] reach the int8 kernel), in the global and the windowed
  (ring) layer alike; a paged cache's global layer calls the paged target of its codec. A paged
  windowed layer stays with XLA (its reads mask to the window), and so does an MLA cache of any
  codec (no kernel reads latents)."""
  config = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, max_len=16, window=(4, 0))
  model = for_decoding(Transformer(config))
  assert model.backend is not XLA_BACKEND  # the CPU kernels' backend
  params = model.init(jax.random.key(0), np.zeros((1, 2), np.int32))["params"]
  tokens, ones = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
  lower = lambda model, params, cache: (
    jax.jit(forward, static_argnames=("model", "last")).lower(model, params, cache, tokens, ones, last=True).as_text()
  )
  calls = lambda text: sorted(set(re.findall(r"@(kvjax_\w*attention\w*)\(", text)))
  contiguous_cache = ContiguousCache.create(config, 2, 16, CacheConfig(dtype=fmt))
  assert attention_kernel.uses_kernel(config.dtype, contiguous_cache.route) == (target is not None)
  contiguous = lower(model, params, contiguous_cache.replace(lengths=jnp.array([3, 9], jnp.int32)))
  assert calls(contiguous) == ([target] if target else [])
  assert contiguous.count(f"@{target}(") == (2 if target else 0)  # both layers
  paged = PagedCache.create(config, 9, 4, 2, 4, CacheConfig(layout="paged", page_size=4, dtype=fmt))
  paged = paged.with_rows(np.arange(1, 9, dtype=np.int32).reshape(2, 4), [3, 9])
  paged_target = attention_kernel.TARGETS["paged", fmt]
  paged_text = lower(model, params, paged)
  assert calls(paged_text) == ([paged_target] if paged_target else [])
  assert paged_text.count(f"@{paged_target}(") == (1 if paged_target else 0)  # the global layer only
  mla_config = config.replace(kv_latent_rank=8, rope_dims=4)
  mla = for_decoding(Transformer(mla_config))
  mla_params = mla.init(jax.random.key(0), np.zeros((1, 2), np.int32))["params"]
  latent = ContiguousCache.create(mla_config, 2, 16, CacheConfig(dtype=fmt)).replace(lengths=jnp.array([3, 9]))
  assert latent.route == ("contiguous", fmt) and calls(lower(mla, mla_params, latent)) == []
