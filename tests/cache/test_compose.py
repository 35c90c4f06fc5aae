"""A cache is a layout x a codec x the payload the attention declares: every combination is made
to fit its model, with the arrays and bytes worked out by hand here; decoding through composed
corners (windowed quantized latents, half-precision payloads) == the forward over what they
store; and what cannot be composed is refused before compute, each with its reason."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cache.layouts import paged
from kvjax.cache.codec import NAMES, codec
from kvjax.cache.config import CacheConfig
from kvjax.model.transformer import cache_layers, cache_payload
from conftest import init_params, tiered, tiny_config
from oracles import StoredForward, forward

BATCH, MAX_LEN, PAGE_SIZE = 2, 12, 4
PAYLOADS = {
  "kv": {},
  "latent": dict(kv_latent_rank=12, rope_dims=8),
  "latent-no-rope": dict(kv_latent_rank=12, positions="learned"),
}
# Layer 0 windowed (4 wide, 1 sink: a ring of 5 slots), layer 1 global; by the model or by the cache.
WINDOW = dict(window=(4, 0), sink_tokens=1)
WINDOWS = ("global", "model", "cache")


def made(payload: str, window: str, layout: str, dtype: str):
  """(config, cache_config, the empty cache kinds.create makes) of one combination."""
  config = tiny_config(2, max_len=16, **PAYLOADS[payload], **(WINDOW if window == "model" else {}))
  cache_config = CacheConfig(layout=layout, dtype=dtype, page_size=PAGE_SIZE, **(WINDOW if window == "cache" else {}))
  return config, cache_config, kinds.create(config, cache_config, BATCH, MAX_LEN)


def widths_by_hand(payload: str) -> dict[str, tuple[int, int]]:
  """{name: (heads, width)} each layer stores per token: tiny_config(2) has 2 kv heads of 8."""
  if payload == "kv":
    return {"k": (2, 8), "v": (2, 8)}
  return {"latent": (1, 12)} if payload == "latent-no-rope" else {"latent": (1, 12), "rope_key": (1, 8)}


def stored_by_hand(dtype: str, width: int) -> tuple[int, np.dtype, int]:
  """(values per vector, their dtype, float32 scales per vector) of `dtype`: int4 packs two per
  byte with a step and a zero point per group, and widths 8 and 12 are one group each; bfloat16 and
  e4m3 are stored as their bits."""
  return {
    "float32": (width, np.float32, 0),
    "bfloat16": (width, np.uint16, 0),
    "float16": (width, np.float16, 0),
    "int8": (width, np.int8, 1),
    "float8_e4m3fn": (width, np.uint8, 1),
    "int4": (width // 2, np.uint8, 2),
  }[dtype]


def vector_bytes_by_hand(dtype: str, width: int) -> int:
  values, stored, scales = stored_by_hand(dtype, width)
  return values * np.dtype(stored).itemsize + 4 * scales


def arrays_by_hand(payload: str, window: str, layout: str, dtype: str, layer: int) -> dict:
  """{name: (shape, dtype)} of one layer: contiguous [B, heads, S, W'] (keys [B, heads, W', S]),
  S = MAX_LEN, or 5 ring slots in a windowed layer; paged pools [heads, P, Z, W'] of
  1 + BATCH x 3 pages; scales where the values have their width (int4: groups) or none."""
  slots = 5 if window != "global" and layer == 0 else MAX_LEN
  pages = 1 + BATCH * -(-MAX_LEN // PAGE_SIZE)
  out = {}
  for name, (heads, width) in widths_by_hand(payload).items():
    values, stored, scales = stored_by_hand(dtype, width)
    if layout == "paged":
      lead = (heads, pages, PAGE_SIZE)
      out[name] = (lead + (values,), np.dtype(stored))
      scale = lead + ((scales,) if dtype == "int4" else ())
    elif name == "k":
      out[name] = ((BATCH, heads, values, slots), np.dtype(stored))
      scale = (BATCH, heads) + ((scales,) if dtype == "int4" else ()) + (slots,)
    else:
      out[name] = ((BATCH, heads, slots, values), np.dtype(stored))
      scale = (BATCH, heads, slots) + ((scales,) if dtype == "int4" else ())
    if scales:
      out[name + "_scale"] = (scale, np.dtype(np.float32))
  return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_every_combination_is_made_to_fit_its_model(payload, window):
  """Each layout x codec x payload x window: the kind CacheConfig.layout names, the payload the
  attention declares, each layer's arrays and their bytes as worked out by hand, the sizes the
  kinds give from the configs alone, its kernel route; and it fits the model it was made for."""
  for layout in ("contiguous", "paged"):
    for dtype in NAMES:
      config, cache_config, cache = made(payload, window, layout, dtype)
      where = f"{layout} {dtype} {payload} {window}"
      assert type(cache) is kinds.kind(cache_config) and cache.layout == layout, where
      assert cache.fields == cache_payload(config) and cache.codec == codec(dtype), where
      assert cache.route == (layout, dtype), where
      assert cache.model_config(config).window == (() if window == "global" else (4, 0)), where
      for i, layer in enumerate(cache_layers(cache.layers)):
        got = {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in layer.items()}
        assert got == arrays_by_hand(payload, window, layout, dtype, i), (where, i)
        assert got == cache.layer_spec(cache.model_config(config), i), (where, i)
      per_position = sum(
        heads * vector_bytes_by_hand(dtype, width) for heads, width in widths_by_hand(payload).values()
      )
      assert kinds.bytes_per_token(config, cache_config) == config.num_layers * per_position, where
      bookkeeping = 4 * BATCH * (1 + -(-MAX_LEN // PAGE_SIZE) if layout == "paged" else 1)
      assert cache.nbytes + bookkeeping == kinds.cache_bytes(config, cache_config, BATCH, MAX_LEN), where
      assert cache.nbytes == sum(
        math.prod(shape) * dt.itemsize
        for i in range(2)
        for shape, dt in arrays_by_hand(payload, window, layout, dtype, i).values()
      ), where
      cache.check_model(config)


# The |logit| gap between decoding a composed cache and the forward over what it stores: float
# rounding, and for a quantized codec (rarely) a value of a deeper layer rounding to a
# neighbouring step (its inputs differ by that rounding); measured 1e-6.
TOLERANCE = {"float16": 1e-5, "bfloat16": 1e-5, "int4": 1e-4, "float8_e4m3fn": 1e-4}
LENGTHS = np.array([9, 3, 6])


@functools.cache
def model_params(payload: str, windowed: bool):
  return init_params(tiny_config(2, max_len=24, **PAYLOADS[payload], **(WINDOW if windowed else {})))


@pytest.mark.parametrize(
  "layout, dtype, payload, windowed",
  tiered(
    [
      ("contiguous", "int4", "latent", True),  # a ring of int4 latents and rotary keys
      ("paged", "float8_e4m3fn", "latent", True),
      ("paged", "bfloat16", "latent-no-rope", False),
      ("contiguous", "float16", "kv", True),
    ],
    [("contiguous", "int4", "latent", True), ("paged", "bfloat16", "latent-no-rope", False)],
  ),
)
def test_decode_of_a_composed_cache_is_the_forward_over_what_it_stores(layout, dtype, payload, windowed):
  """Corners the concept tests do not reach (test_codec: K/V through every codec; test_latent:
  latents through them; test_window: rings of float and int8): a ragged prefill and decode steps
  past the ring's wrap give the windowed forward's logits over the payload as the codec stores it,
  which differ from the float forward's."""
  model, params = model_params(payload, windowed)
  seqs = np.random.default_rng(3).integers(0, 64, (3, 20)).astype(np.int32)
  tolerance = TOLERANCE[dtype]
  stored = forward(model, params, seqs, StoredForward(codec(dtype), 3))
  assert np.abs(stored - forward(model, params, seqs)).max() > 10 * tolerance
  cache_config = CacheConfig(layout=layout, dtype=dtype, page_size=PAGE_SIZE)
  logits, cache = kvjax.prefill(model, params, seqs[:, :9], LENGTHS, 24, cache_config=cache_config)
  assert cache.route == (layout, dtype)
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(logits[row, :n], stored[row, :n], atol=tolerance)
  for step in range(8):  # row 0 reaches position 16: the 5-slot ring has wrapped twice
    positions = LENGTHS + step
    logits, cache = kvjax.decode_step(model, params, cache, seqs[np.arange(3), positions])
    np.testing.assert_allclose(logits, stored[np.arange(3), positions], atol=tolerance, err_msg=f"step {step}")


def test_what_cannot_be_composed_is_refused_with_its_reason():
  """Each refusal in the one place that knows it (CacheConfig, the codec, the layout, the
  engine), before any array is allocated or computed."""
  for changes, message in (
    (dict(dtype="int3"), r"CacheConfig.dtype must be one of \('float32', .*'int4'.*\) or None, got 'int3'"),
    (
      dict(layout="ring"),
      r"CacheConfig.layout must be one of \('contiguous', 'evict', 'kivi', 'paged', 'paged_evict'\), got 'ring'",
    ),
    (dict(page_size=0), "CacheConfig.page_size must be a positive integer, got 0"),
    (dict(absorb=1), "CacheConfig.absorb must be True or False, got 1"),
    (dict(paged_read="flash"), "CacheConfig.paged_read must be one of"),
    (
      dict(paged_read="pallas_interpret"),
      r"paged_read='pallas_interpret' reads float page pools only; use "
      r"'gather' with layout='contiguous'",
    ),
    (
      dict(layout="paged", dtype="int8", paged_read="pallas"),
      r"reads float page pools only; use 'gather' "
      r"with layout='paged' and dtype='int8'",
    ),
  ):
    with pytest.raises(ValueError, match=message):
      CacheConfig(**changes)
  assert CacheConfig(dtype="fp8").dtype == "float8_e4m3fn"  # aliases resolve to the codec's name

  # int4 packs two values per byte: an odd width is refused by the codec, for K/V and latents alike.
  odd_head = tiny_config(2, d_model=36, positions="learned")  # head_dim 9
  odd_latent = tiny_config(2, kv_latent_rank=7, rope_dims=4)
  int4 = CacheConfig(dtype="int4")
  for config, name in ((odd_head, "k"), (odd_latent, "latent")):
    for layout in ("contiguous", "paged"):
      with pytest.raises(
        ValueError,
        match=f"an int4 cache packs two values per byte, which needs an even width; "
        f"the model's cached {name} is {9 if name == 'k' else 7} wide",
      ):
        kinds.create(config, int4.replace(layout=layout), 1, 8)
  with pytest.raises(ValueError, match="the model's cached latent is 7 wide"):
    kvjax.generate(kvjax.Transformer(odd_latent), None, np.ones((1, 3), np.int32), np.array([3]), 2, cache_config=int4)
  kinds.create(odd_latent, CacheConfig(dtype="int8"), 1, 8)  # int8 stores any width

  mla = tiny_config(2, **PAYLOADS["latent"])
  if paged.pallas_kernel() is not None:
    with pytest.raises(
      ValueError, match="paged_read='pallas_interpret' reads K/V pools; an MLA model's pages are read by 'gather'"
    ):
      kinds.create(mla, CacheConfig(layout="paged", paged_read="pallas_interpret"), 1, 8)
  model = kvjax.Transformer(tiny_config(2))
  if not paged.pallas_available():
    with pytest.raises(
      ValueError, match=f"paged_read='pallas' needs a GPU backend .* the backend is '{jax.default_backend()}'"
    ):
      kvjax.Engine(model, None, kvjax.EngineConfig(cache=CacheConfig(layout="paged", paged_read="pallas")))
  with pytest.raises(
    ValueError,
    match=r"EngineConfig.cache must be a CacheConfig with layout='paged' \(the engine "
    r"allocates pages\), or 'paged_evict' with a press, got CacheConfig\(layout='contiguous'",
  ):
    kvjax.EngineConfig(cache=CacheConfig(layout="contiguous"))
  with pytest.raises(ValueError, match="an int4 cache packs two values per byte"):
    kvjax.Engine(
      kvjax.Transformer(odd_latent), None, kvjax.EngineConfig(cache=CacheConfig(layout="paged", dtype="int4"))
    )
