"""One prefill, many caches (kvjax.decoding.many): every cache prefill_many makes equals, array for
array, the cache its own `prefill` makes, for every registered press at several ratios, AdaKV's
and PyramidKV's budgets, a codec, KVzip and a chunked prefill under a budget; the answers that
answer_many decodes for them in one batch equal each cache's own, under both protocols; what
cannot share a prefill or a batch is refused by name."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import init_params, tiny_config

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.fanout import Fanout
from kvjax.cache.kvzip import KVzip
from kvjax.cache.presses import PRESSES, SnapKV, make_press
from kvjax.cache.layouts.stack import stack
from kvjax.decoding import decode
from kvjax.decoding.many import answer_many, batch_size, prefill_many
from kvjax.studies.base import measure

RNG = np.random.default_rng(0)
TOKENS = RNG.integers(0, 64, (2, 40)).astype(np.int32)
LENGTHS = np.array([40, 33], np.int32)
QUESTION = RNG.integers(0, 64, (2, 6)).astype(np.int32)
ASKED = np.array([6, 4], np.int32)
KVZIP = KVzip(sinks=2, chunk_size=16, prefix=3, repeat_ids=(5, 6, 7), resume_ids=(8, 9), suffix_ids=(10, 11))
SETTINGS = {"snapkv": {"window": 4}, "chunkkv": {"chunk_length": 8, "scorer": SnapKV(window=4)}}


def _configs() -> list[CacheConfig]:
  out = [CacheConfig(), CacheConfig(dtype="int8")]
  for name in PRESSES:
    if name == "kvzip":
      out += [CacheConfig(press=dataclasses.replace(KVZIP, compression_ratio=r)) for r in (0.5, 0.75)]
      continue
    out += [CacheConfig(press=make_press(name, compression_ratio=r, **SETTINGS.get(name, {}))) for r in (0.25, 0.75)]
  snap = SETTINGS["snapkv"]
  out += [
    CacheConfig(press=make_press("snapkv", compression_ratio=0.5, heads="adaptive", **snap)),
    CacheConfig(press=make_press("snapkv", compression_ratio=0.5, layers="pyramid", **snap)),
    CacheConfig(dtype="int8", press=make_press("snapkv", compression_ratio=0.5, **snap)),
  ]
  return out


CONFIGS = _configs()
# Answered in one batch against each cache's own decoding: every press once (its uneven heads,
# its codec, its pyramid), not every ratio (a ratio changes what is kept, not how it is read).
ANSWERED = [c for c in CONFIGS if c.press is None or c.press.compression_ratio != 0.25]
CHUNKED = CacheConfig(press=make_press("knorm", compression_ratio=0.5, decode_budget=16, prefill_chunk=16))
# The first tier's share: one cache of each way a cache is made and read back (float and int8,
# a layer press, an attention press, AdaKV's uneven heads, a pyramid, KVzip's model-level pass,
# a press with a codec); the second tier runs every config.
FEW = [
  c
  for c in ANSWERED
  if c.press is None
  or c.dtype is not None
  or c.press.heads == "adaptive"
  or c.press.layers == "pyramid"
  or c.press.name in ("snapkv", "expected_attention")
  or c.press == dataclasses.replace(KVZIP, compression_ratio=0.5)
]


@pytest.fixture(scope="module")
def model():
  return init_params(tiny_config(2, max_len=256))


def _same(a, b) -> list[str]:
  """The leaves (by path) where two caches differ; [] when equal array for array."""
  left, right = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  return [jax.tree_util.keystr(p) for (p, x), (_, y) in zip(left, right) if not np.array_equal(x, y)]


@pytest.mark.parametrize("part", ["few", *(pytest.param(p, marks=pytest.mark.tier2) for p in range(3))])
def test_every_cache_equals_its_own_prefill(model, part):
  """The first tier's few configs, or a third of them all per test (each compiles its own
  prefill as the reference)."""
  model, params = model
  configs = FEW + [CHUNKED] if part == "few" else (CONFIGS + [CHUNKED])[part::3]
  many = prefill_many(model, params, TOKENS, LENGTHS, 64, configs)
  for config, (logits, cache) in zip(configs, many):
    ref_logits, ref = decode.prefill(model, params, TOKENS, LENGTHS, 64, logits="last", cache_config=config)
    assert np.array_equal(logits, ref_logits), config
    assert _same(cache, ref) == [], config


def test_all_logits_cut_to_the_prompt(model):
  model, params = model
  (logits, _), (int8_logits, _) = prefill_many(model, params, TOKENS, LENGTHS, 64, CONFIGS[:2], logits="all")
  ref, _ = decode.prefill(model, params, TOKENS, LENGTHS, 64, cache_config=CacheConfig(dtype="int8"))
  assert logits.shape == (2, 40, 64) and np.array_equal(int8_logits, ref)


@pytest.mark.parametrize(
  "protocol, every",
  [("query_agnostic", False)]  # the query-aware protocol's answers: the second tier, and tests/studies/test_measure.py
  + [pytest.param("query_aware", False, marks=pytest.mark.tier2)]
  + [pytest.param(p, True, marks=pytest.mark.tier2) for p in ("query_agnostic", "query_aware")],
)
def test_answers_in_one_batch_equal_each_caches_own(model, protocol, every):
  """FEW's caches in the first tier, every press's in the second."""
  model, params = model
  answered = ANSWERED if every else FEW
  new = 10
  if protocol == "query_agnostic":
    tokens, lengths, kw = TOKENS, LENGTHS, {"question": QUESTION, "question_lengths": ASKED}
  else:
    tokens = np.concatenate([TOKENS, np.zeros_like(QUESTION)], axis=1)
    for r in range(2):
      tokens[r, LENGTHS[r] : LENGTHS[r] + ASKED[r]] = QUESTION[r, : ASKED[r]]
    lengths, kw = LENGTHS + ASKED, {}
  prefilled = prefill_many(model, params, tokens, lengths, 40 + 6 + new, answered)
  if protocol == "query_aware":
    kw = {"first": [np.asarray(logits.argmax(-1)) for logits, _ in prefilled]}
  got = answer_many(model, params, [c for _, c in prefilled], new, stop_ids=(3,), **kw)
  for config, answers in zip(answered, got):
    ref = measure.answers(model, params, tokens, lengths, new, config, stop_ids=(3,), **kw_of(kw))
    assert [a.tolist() for a in answers] == [np.asarray(r).tolist() for r in ref], config


def test_a_row_stops_where_until_says_its_answer_ended(model):
  model, params = model
  prefilled = prefill_many(model, params, TOKENS, LENGTHS, 64, ANSWERED)
  caches = [c for _, c in prefilled]
  kw = {"question": QUESTION, "question_lengths": ASKED}

  def until(ids):
    return len(ids) >= 2 and ids[-1] % 3 == 0

  full = answer_many(model, params, caches, 12, **kw)
  cut = answer_many(model, params, caches, 12, until=until, **kw)
  ended = 0
  for whole, stopped in zip(full, cut):
    for a, b in zip(whole, stopped):
      k = next((k for k in range(1, len(a) + 1) if until(a[:k].tolist())), len(a))
      ended += k < len(a)
      assert b.tolist() == a[:k].tolist()
  assert ended > 0  # some rows did stop early


def kw_of(kw: dict) -> dict:
  return {k: v for k, v in kw.items() if k != "first"}


def test_batches_are_bounded_shapes():
  assert [batch_size(n) for n in (1, 2, 3, 5, 8, 9, 17, 37)] == [1, 2, 4, 8, 8, 16, 24, 40]


def test_what_cannot_share_is_refused_by_name(model):
  model, params = model
  with pytest.raises(ValueError, match="at least one CacheConfig"):
    prefill_many(model, params, TOKENS, LENGTHS, 64, [])
  with pytest.raises(ValueError, match=r"cache_configs\[1\] must be a CacheConfig"):
    prefill_many(model, params, TOKENS, LENGTHS, 64, [CacheConfig(), "snapkv"])
  with pytest.raises(ValueError, match="max_len=32"):
    prefill_many(model, params, TOKENS, LENGTHS, 32, CONFIGS[:1])
  float32, int8 = (kinds.create(model.config, c, 2, 64) for c in CONFIGS[:2])
  with pytest.raises(ValueError, match="cache 1 .* reads a prompt back unlike cache 0"):
    Fanout.of([float32, int8])
  zipped = kinds.create(model.config, CONFIGS[2 + 2 * list(PRESSES).index("kvzip")], 2, 64, prompt=40)
  with pytest.raises(ValueError, match="KVzip"):
    Fanout.of([float32, zipped])
  (_, budgeted), (_, full) = prefill_many(model, params, TOKENS, LENGTHS, 64, [CHUNKED, CacheConfig()])
  with pytest.raises(ValueError, match="presses while decoding"):
    stack(model.config, [full, budgeted], 64)
  with pytest.raises(ValueError, match="slots=16 is fewer than the 40 tokens"):
    stack(model.config, [full], 16)
  with pytest.raises(ValueError, match="one of them"):
    answer_many(model, params, [full], 4)


def test_mla_caches_answer_in_one_batch_as_each_their_own():
  """MLA's latent caches (which no evicting cache holds) are joined as one contiguous cache: two
  full caches of an MLA model, answered together, answer as each alone."""
  model, params = init_params(tiny_config(2, max_len=256, kv_latent_rank=16, rope_dims=4))
  prefilled = prefill_many(model, params, TOKENS, LENGTHS, 56, [CacheConfig(), CacheConfig()])
  got = answer_many(
    model, params, [c for _, c in prefilled], 10, stop_ids=(3,), question=QUESTION, question_lengths=ASKED
  )
  kw = {"question": QUESTION, "question_lengths": ASKED}
  ref = measure.answers(model, params, TOKENS, LENGTHS, 10, CacheConfig(), stop_ids=(3,), **kw_of(kw))
  for answers in got:
    assert [a.tolist() for a in answers] == [np.asarray(r).tolist() for r in ref]
