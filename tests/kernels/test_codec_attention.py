"""The CPU decode-attention kernel over the bfloat16, float16, fp8 and int4 caches: each route
against kvjax's XLA attention over the decoded cache (contiguous and paged, ragged rows, GQA,
MQA and MHA), and decoding through each codec's cache against decoding with the kernels off."""

import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import init_params, tiered, tiny_config
from kvjax.cache.codec import codec as codec_named
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.contiguous import attend_one
from kvjax.cache.layouts.paged import attend_pages
from kvjax.decoding import decode
from kvjax.kernels import attention as attention_kernel
from kvjax.model.backend import XLA

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or shutil.which("g++") is None and shutil.which("c++") is None,
  reason="the kernel is built for the CPU with the system's C++ compiler",
)

CODECS = ("bfloat16", "float16", "float8_e4m3fn", "int4")
FLOAT = functools.partial(attend_one, codec=codec_named("float32"))  # the reference over decoded values
# Bits a read of an unused page would show: NaN for the float codecs, NaN scales for the others.
GARBAGE = {"bfloat16": np.nan, "float16": np.nan, "float8_e4m3fn": 0x7F, "int4": 0xFF}


def storage(name, batch, kv_heads, groups, head_dim, page_size, pages, lengths, paged, seed=0):
  """q, the codec's storage of random keys and values (contiguous: k [B, K, H', S] and
  v [B, K, S, H'], scales beside them; paged: the rows' pages shuffled over a pool whose unused
  pages hold garbage, entries past a row's pages on the null page 0), lengths, its addressing,
  and the decoded k [B, K, H, S], v [B, K, S, H] in float32."""
  rng = np.random.default_rng(seed)
  codec = codec_named(name)
  s = page_size * pages
  lengths = np.asarray(lengths, np.int32)
  q = rng.standard_normal((batch, 1, kv_heads * groups, head_dim), np.float32)
  k, v = (rng.standard_normal((batch, kv_heads, s, head_dim), np.float32) * 2 for _ in range(2))
  (k_codes, k_scale), (v_codes, v_scale) = codec.encode(jnp.asarray(k)), codec.encode(jnp.asarray(v))
  k_float = np.asarray(codec.decode(k_codes, k_scale), np.float32).swapaxes(2, 3)
  v_float = np.asarray(codec.decode(v_codes, v_scale), np.float32)
  k_codes, v_codes = np.asarray(k_codes), np.asarray(v_codes)
  scales = {} if k_scale is None else {"k_scale": np.asarray(k_scale), "v_scale": np.asarray(v_scale)}
  if not paged:
    if "k_scale" in scales and codec.grouped:
      scales["k_scale"] = scales["k_scale"].swapaxes(2, 3)  # [B, K, 2G, S], transposed like the keys
    return q, k_codes.swapaxes(2, 3), v_codes, lengths, scales, (k_float, v_float)

  table = rng.permutation(np.arange(1, batch * pages + 1)).reshape(batch, pages).astype(np.int32)
  used = np.arange(pages)[None, :] < -(-(lengths[:, None] + 1) // page_size)

  def paginate(rows, fill):  # rows [B, K, S, ...] -> pool [K, P, Z, ...]; the unused pages hold `fill`
    pool = np.full((kv_heads, batch * pages + 1, page_size, *rows.shape[3:]), fill, rows.dtype)
    pool[:, table] = rows.reshape(batch, kv_heads, pages, page_size, *rows.shape[3:]).swapaxes(0, 1)
    pool[:, table[~used]] = fill
    return pool

  fill = GARBAGE[name]
  if not scales:
    fill = np.asarray(codec.encode(jnp.asarray(fill, jnp.float32))[0])  # NaN as the codec stores it
  elif name == "float8_e4m3fn":
    fill = np.asarray(0x7F, np.uint8)
  addressing = {n: paginate(a, np.nan) for n, a in scales.items()}
  addressing["page_table"] = np.where(used, table, 0).astype(np.int32)
  return q, paginate(k_codes, fill), paginate(v_codes, fill), lengths, addressing, (k_float, v_float)


SHAPES = [
  (4, 2, 4, 64, 16, 4, [0, 15, 63, 40]),  # GQA-4, H = 64: one position, one page, every page, ragged
  (2, 1, 6, 32, 8, 40, [319, 100]),  # MQA over 320 positions: chunks merged
  (3, 3, 1, 12, 5, 7, [4, 34, 17]),  # MHA, H = 12 (int4 groups of 12) and odd page size
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("batch,kv_heads,groups,head_dim,page_size,pages,lengths", SHAPES)
def test_route_matches_xla(name, paged, batch, kv_heads, groups, head_dim, page_size, pages, lengths):
  q, k, v, lengths, addressing, (k_float, v_float) = storage(
    name, batch, kv_heads, groups, head_dim, page_size, pages, lengths, paged
  )
  route = ("paged" if paged else "contiguous", name)
  xla = functools.partial(attend_pages if paged else attend_one, codec=codec_named(name))
  kernel = jax.jit(lambda *a, **kw: attention_kernel.cache_attention(route, *a, xla, **kw))
  assert re.search(rf"@{attention_kernel.TARGETS[route]}\(", kernel.lower(q, k, v, lengths, **addressing).as_text())
  out = np.asarray(kernel(q, k, v, lengths, **addressing))
  assert np.isfinite(out).all()  # nothing read from the unused pages
  np.testing.assert_allclose(out, FLOAT(q, k_float, v_float, lengths), rtol=1e-5, atol=1e-5)


def test_fp8_reads_every_code():
  # The 254 finite e4m3fn codes (subnormals, both zeros, the largest) as the values of one row, its
  # keys equal, so that the output is the mean of the values read: the kernel's widening against
  # numpy's. The codec writes a NaN code (0x7F) only beside a NaN scale: the row's output is NaN.
  finite = np.arange(256, dtype=np.uint8)[(np.arange(256) & 0x7F) != 0x7F].view(jnp.float8_e4m3fn)
  v = np.stack([finite, finite[::-1]], -1)[None, None].repeat(2, 0)  # [B, K, S, H] = [2, 1, 254, 2]
  k = np.zeros((2, 1, 2, 254), jnp.float8_e4m3fn)
  scale = np.ones((2, 1, 254), np.float32)
  q = np.ones((2, 1, 1, 2), np.float32)
  lengths = np.array([253, 100], np.int32)
  route, xla = ("contiguous", "float8_e4m3fn"), functools.partial(attend_one, codec=codec_named("float8_e4m3fn"))
  bits = lambda a: a.view(np.uint8)  # how the codec stores e4m3
  out = np.asarray(
    attention_kernel.cache_attention(route, q, bits(k), bits(v), lengths, xla, k_scale=scale, v_scale=scale)
  )
  expected = [v[b, 0, : lengths[b] + 1].astype(np.float64).mean(0) for b in range(2)]
  np.testing.assert_allclose(out[:, 0, 0], expected, rtol=1e-5, atol=1e-7)
  v[0, 0, 7, 0] = np.uint8(0x7F).view(jnp.float8_e4m3fn)
  scale[0, 0, 7] = np.nan
  out = np.asarray(
    attention_kernel.cache_attention(route, q, bits(k), bits(v), lengths, xla, k_scale=scale, v_scale=scale)
  )
  assert np.isnan(out[0, 0, 0, 0]) and np.isfinite(out[1]).all()


@pytest.mark.parametrize(
  "name,layout,num_kv_heads",
  tiered(
    [("bfloat16", "contiguous", 2), ("float16", "paged", 1), ("float8_e4m3fn", "paged", 2), ("int4", "contiguous", 1)],
    [("bfloat16", "contiguous", 2), ("float8_e4m3fn", "paged", 2)],
    ids=["bfloat16-contiguous-gqa", "float16-paged-mqa", "fp8-paged-gqa", "int4-contiguous-mqa"],
  ),
)
def test_decode_through_each_codec_matches_kernels_off(name, layout, num_kv_heads):
  """Prefill ragged prompts into a cache of the codec, then decode greedily: the decode steps with
  the CPU kernels (decode.decode_step) give the logits of the same steps computed by XLA alone
  (decode.forward on the model without the kernels' backend), and the kernel's target is called."""
  model, params = init_params(tiny_config(num_kv_heads))
  config = CacheConfig(layout=layout, page_size=4, dtype=name)
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (3, 9), 0, model.config.vocab_size), np.int32)
  lengths = np.array([9, 4, 1], np.int32)
  target = attention_kernel.TARGETS[layout, name]
  xla_step = jax.jit(decode.forward, static_argnames=("model", "last"))
  ones = jnp.ones((3,), jnp.int32)
  logits_k, cache_k = decode.prefill(model, params, tokens, lengths, 20, logits="last", cache_config=config)
  logits_x, cache_x = decode.prefill(model, params, tokens, lengths, 20, logits="last", cache_config=config)
  lowered = xla_step.lower(decode.for_decoding(model), params, cache_k, jnp.zeros((3, 1), jnp.int32), ones, last=True)
  assert f"@{target}(" in lowered.as_text() and model.backend is XLA  # the reference is XLA alone
  for _ in range(3):
    token = np.asarray(jnp.argmax(logits_x, -1), np.int32)
    logits_k, cache_k = decode.decode_step(model, params, cache_k, token)
    logits_x, cache_x = xla_step(model, params, cache_x, jnp.asarray(token)[:, None], ones, last=True)
    np.testing.assert_allclose(logits_k, logits_x, rtol=1e-4, atol=1e-4)
