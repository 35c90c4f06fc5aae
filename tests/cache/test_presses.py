"""A press is a value on CacheConfig.press (kvjax.cache.presses): chosen by name and set field by
field from --set (kvjax.fields.apply_overrides), refused with one error naming the press or field,
written to and read back from a dict (config.json, a study's variants), and entered in PRESSES by
its class definition alone."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import PRESSES, TOVA, ObservedAttention, Press, Random, SnapKV, StreamingLLM, make_press
from kvjax.fields import apply_overrides, config_keys, from_dict, to_dict

NAMES = ", ".join(PRESSES)  # the registry, as the errors list it


@dataclasses.dataclass(frozen=True)
class Variants:
  """A study's shape: a tuple of caches, given on the command line as dicts."""

  caches: tuple[CacheConfig, ...] = ()


def test_set_by_name_then_by_field():
  config = apply_overrides(
    CacheConfig(), ["press=snapkv", "press.window=32", "press.compression_ratio=0.5", "press.heads=adaptive"]
  )
  assert config == CacheConfig(press=SnapKV(compression_ratio=0.5, window=32, heads="adaptive"))
  assert config.layout == "evict" and config.press.kernel == 5  # the fields not set keep SnapKV's defaults
  # a name gives that press with its own defaults; None drops it, and the layout follows
  assert apply_overrides(config, ["press=tova"]).press == TOVA()
  assert apply_overrides(config, ["press=None"]) == CacheConfig()
  assert apply_overrides(CacheConfig(), ["press={'name': 'random', 'seed': 3}"]).press == Random(seed=3)
  assert apply_overrides(CacheConfig(dtype="int8"), ["press=observed"]) == CacheConfig(
    dtype="int8", press=ObservedAttention()
  )


def test_the_keys_of_a_press_are_listed_as_config_keys():
  keys = config_keys(CacheConfig(press=StreamingLLM()))
  assert [k for k in keys if k.startswith("press")] == [
    "press.compression_ratio",
    "press.heads",
    "press.safeguard",
    "press.layers",
    "press.beta",
    "press.decode_budget",
    "press.decode_interval",
    "press.prefill_chunk",
    "press.sinks",
  ]
  assert "press" in config_keys(CacheConfig())


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["press=h2o"], f"press: unknown press 'h2o'; valid: {NAMES}"),
    (["press=SnapKV"], "unknown press 'SnapKV'"),
    (["press=3"], f"press expects a press by name ({NAMES}) or a dict with its 'name', got 3"),
    (["press={'window': 8}"], "or a dict with its 'name', got {'window': 8}"),
    (["press={'name': 'tova', 'window': 8}"], "press: unknown TOVA keys ['window']; valid keys: compression_ratio"),
    (["press.window=8"], f"press.window: press is None; choose the press first, press=NAME ({NAMES})"),
    (
      ["press=tova", "press.window=8"],
      "unknown config key 'press.window'; valid keys: .*press.prefill_chunk, rotation$",
    ),
    (["press=snapkv", "press.window='8'"], "press.window expects int, got '8' (str)"),
    (["press=snapkv", "press.window=2.0"], "press.window expects int, got 2.0 (float)"),
    (["press=snapkv", "press.kernel=4"], "SnapKV.kernel must be odd"),
    (
      ["press=knorm", "press.compression_ratio=1"],
      "KNorm.compression_ratio must be a finite number in [0, 1), got 1.0",
    ),
    (["press=knorm", "press.heads=adakv"], "KNorm.heads must be one of ('uniform', 'adaptive'), got 'adakv'"),
    (["press=knorm", "layout='paged'"], "evicts tokens, which layout='paged' does not"),
    (["layout='evict'"], "CacheConfig.layout='evict' needs a press"),
  ],
)
def test_mistakes_are_refused_with_one_named_error(overrides, message):
  pattern = message if message.endswith("$") or ".*" in message else _literal(message)
  with pytest.raises(ValueError, match=pattern):
    apply_overrides(CacheConfig(), overrides)


def _literal(text: str) -> str:
  for c in "\\[](){}.*?+^$|":
    text = text.replace(c, "\\" + c)
  return text


@pytest.mark.parametrize(
  "config",
  [
    CacheConfig(),
    CacheConfig(press=SnapKV(compression_ratio=0.75, window=32, kernel=3)),
    CacheConfig(press=StreamingLLM(compression_ratio=0.5, sinks=2), dtype="int8"),
    CacheConfig(press=Random(seed=7, heads="adaptive", safeguard=0.5)),
  ],
)
def test_a_config_round_trips_through_json(config):
  recorded = json.loads(json.dumps(to_dict(config)))
  assert from_dict(CacheConfig, recorded) == config
  if config.press is not None:
    assert recorded["press"]["name"] == config.press.name


def test_caches_given_as_dicts_read_back():
  caches = (CacheConfig(dtype="int8"), CacheConfig(press=SnapKV(compression_ratio=0.5)), CacheConfig(press=TOVA()))
  given = apply_overrides(Variants(), [f"caches={[to_dict(c) for c in caches]!r}"])
  assert given == Variants(caches) and given.caches[1].layout == "evict"
  with pytest.raises(ValueError, match="CacheConfig.press: unknown press 'h2o'; valid: streaming_llm"):
    apply_overrides(Variants(), ["caches=[{'press': {'name': 'h2o'}}]"])


def test_the_dict_of_a_press_names_it_beside_its_fields():
  assert to_dict(SnapKV(compression_ratio=0.5)) == {
    "name": "snapkv",
    "compression_ratio": 0.5,
    "heads": "uniform",
    "safeguard": 0.2,
    "layers": "uniform",
    "beta": 20,
    "decode_budget": 0,
    "decode_interval": 1,
    "prefill_chunk": 0,
    "window": 64,
    "kernel": 5,
  }
  assert to_dict(CacheConfig(press=TOVA()))["layout"] == "evict"


def test_make_press_builds_one_by_name():
  assert make_press("snapkv", compression_ratio=0.5, window=8) == SnapKV(compression_ratio=0.5, window=8)
  with pytest.raises(ValueError, match=f"press: unknown press 'h2o'; valid: {NAMES}"):
    make_press("h2o")
  with pytest.raises(ValueError, match="unknown StreamingLLM keys \\['window'\\]"):
    make_press("streaming_llm", window=8)


def test_a_new_press_is_one_class():
  """Defining a Press subclass with a name enters it in PRESSES: --set and dicts then find it."""

  @dataclasses.dataclass(frozen=True)
  class Oldest(Press):
    keep_first: int = 1
    name: ClassVar[str] = "oldest_test"

  try:
    assert PRESSES["oldest_test"] is Oldest
    config = apply_overrides(CacheConfig(), ["press=oldest_test", "press.keep_first=3"])
    assert config.press == Oldest(keep_first=3) and config.layout == "evict"
    assert from_dict(CacheConfig, to_dict(config)) == config
    with pytest.raises(TypeError, match="the name 'oldest_test' is Oldest's already"):

      @dataclasses.dataclass(frozen=True)
      class Again(Press):
        name: ClassVar[str] = "oldest_test"
  finally:
    PRESSES.pop("oldest_test", None)
  assert "oldest_test" not in PRESSES
