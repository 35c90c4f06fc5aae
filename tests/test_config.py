"""kvjax.config: ModelConfig validation (every bad field is named with its value), the field
checks, and apply_overrides / to_dict / from_dict on TrainRun and on a run config of another shape."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from kvjax.config import ModelConfig
from kvjax.fields import apply_overrides, check_positive_int, config_keys, from_dict, to_dict
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def test_defaults_are_derived():
  cfg = ModelConfig(d_model=96, num_heads=6, num_kv_heads=2)
  assert (cfg.head_dim, cfg.q_per_kv, cfg.mlp_dim) == (16, 3, 256)
  assert ModelConfig(d_model=64, activation="gelu").mlp_dim == 256


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(num_heads=8, num_kv_heads=3), "num_heads=8 is not divisible by num_kv_heads=3"),
    (dict(num_kv_heads=0), "num_kv_heads must be a positive integer, got 0"),
    (dict(d_model=-4), "d_model must be a positive integer, got -4"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer, got 2.5"),
    (dict(activation="relu"), "activation must be one of .* got 'relu'"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(positions="alibi"), "positions must be one of"),
    (dict(dtype="float8"), "dtype must be one of"),
    (dict(d_model=100, num_heads=3), "d_model=100 is not divisible by num_heads=3"),
    (dict(head_dim=7, d_model=28, num_heads=4), "head_dim=7 must be even for RoPE"),
    (dict(max_len=0), "max_len must be a positive integer"),
  ],
)
def test_invalid_values_name_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(**kwargs)


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "4", None])
def test_check_positive_int_names_the_value(value):
  with pytest.raises(ValueError, match=re.escape(f"batch must be a positive integer, got {value!r}")):
    check_positive_int(value, "batch")
  check_positive_int(1, "batch")


@dataclasses.dataclass(frozen=True)
class Sweep:
  kv_heads: tuple[int, ...] = (1, 2, 4)
  label: str | None = None
  scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class TableRun:
  """A run config shaped unlike TrainRun: the machinery must not depend on TrainRun's fields."""

  job: str = "gqa_table"
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  sweep: Sweep = dataclasses.field(default_factory=Sweep)


def test_overrides_parse_each_type():
  run = apply_overrides(
    TrainRun(),
    [
      "train.steps=10",
      "train.warmup_steps=2",
      "train.lr=3e-4",
      "train.bf16=True",
      "model.num_kv_heads=2",
      "data.source=/tmp/some dir/corpus.txt",
      "data.val_fraction=0.1",
      "model.dtype='bfloat16'",
      "model.head_dim=None",
      "train.weight_decay=0",
    ],
  )
  assert run.train.steps == 10 and run.train.warmup_steps == 2
  assert run.train.lr == 3e-4 and run.train.bf16 is True
  assert run.model.num_kv_heads == 2 and run.model.q_per_kv == 2
  assert run.data.source == "/tmp/some dir/corpus.txt"  # not a literal: taken as a string
  assert run.model.dtype == "bfloat16"
  assert run.train.weight_decay == 0.0 and isinstance(run.train.weight_decay, float)
  # Untouched sections are unchanged.
  assert run.data.seq_len == DataConfig().seq_len and run.train.batch_size == TrainConfig().batch_size


def test_derived_defaults_follow_their_inputs():
  base = TrainRun()
  run = apply_overrides(base, ["model.d_model=256", "model.dtype=bfloat16"])
  assert run.model.head_dim == 256 // base.model.num_heads
  assert run.model.mlp_dim == ModelConfig(d_model=256).mlp_dim
  explicit = TrainRun(model=ModelConfig(head_dim=48))
  assert apply_overrides(explicit, ["model.d_model=256"]).model.head_dim == 48


def test_later_overrides_win_and_input_is_not_mutated():
  base = TrainRun()
  run = apply_overrides(base, ["train.steps=10", "train.steps=20"])
  assert run.train.steps == 20 and base.train.steps == TrainConfig().steps


@pytest.mark.parametrize(
  "item, message",
  [
    ("train.stepz=1", "unknown config key 'train.stepz'"),
    ("model=3", "unknown config key 'model'"),
    ("train.steps.x=3", "unknown config key 'train.steps.x'"),
    ("nosuch=1", "unknown config key 'nosuch'"),
  ],
)
def test_unknown_key_lists_valid_keys(item, message):
  with pytest.raises(ValueError, match=message) as err:
    apply_overrides(TrainRun(), [item])
  assert "train.steps" in str(err.value) and "model.num_kv_heads" in str(err.value)
  assert "data.source" in str(err.value)


@pytest.mark.parametrize(
  "item, message",
  [
    ("train.steps=1.5", "train.steps expects int, got 1.5"),
    ("train.steps=ten", "train.steps expects int, got 'ten'"),
    ("train.bf16=1", "train.bf16 expects bool, got 1"),
    ("train.batch_size=True", "train.batch_size expects int, got True"),
    ("model.dtype=3", "model.dtype expects str, got 3"),
    ("train.lr='fast'", "train.lr expects float"),
  ],
)
def test_wrong_type_names_key_and_value(item, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(TrainRun(), [item])


@pytest.mark.parametrize(
  "item, message",
  [
    ("model.num_kv_heads=3", "num_heads=4 is not divisible by num_kv_heads=3"),
    ("train.lr=-1.0", "TrainConfig.lr must be a finite number"),
    ("train.warmup_steps=-1", "TrainConfig.warmup_steps must be a non-negative integer"),
    ("data.val_fraction=0.9", "DataConfig.val_fraction"),
    ("data.seq_len=4096", "DataConfig.seq_len=4096 exceeds ModelConfig.max_len"),
    ("model.vocab_size=100", "too small for the byte tokenizer"),
  ],
)
def test_values_are_validated(item, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(TrainRun(), [item])


@pytest.mark.parametrize("item", ["train.steps", "=3", "", "  =  "])
def test_malformed_items(item):
  with pytest.raises(ValueError, match="not of the form key=value"):
    apply_overrides(TrainRun(), [item])


def test_json_round_trip_train_run():
  run = apply_overrides(TrainRun(), ["model.num_kv_heads=1", "train.steps=7", "train.warmup_steps=0"])
  text = json.dumps(to_dict(run))
  assert from_dict(TrainRun, json.loads(text)) == run


def test_generic_over_other_run_configs():
  table = apply_overrides(
    TableRun(), ["sweep.kv_heads=(1, 4)", "sweep.label=wide", "sweep.scale=2", "model.num_layers=1"]
  )
  assert table.sweep == Sweep(kv_heads=(1, 4), label="wide", scale=2.0)
  assert table.model.num_layers == 1
  data = json.loads(json.dumps(to_dict(table)))
  assert data["sweep"]["kv_heads"] == [1, 4]
  assert from_dict(TableRun, data) == table
  assert "sweep.kv_heads" in config_keys(table) and "job" in config_keys(table)
  with pytest.raises(ValueError, match=r"sweep.kv_heads\[1\] expects int"):
    apply_overrides(TableRun(), ["sweep.kv_heads=(1, 'x')"])


def test_from_dict_errors():
  with pytest.raises(ValueError, match=r"unknown TrainConfig keys \['stepz'\]"):
    from_dict(TrainRun, {"train": {"stepz": 3}})
  with pytest.raises(ValueError, match="TrainConfig.steps expects int"):
    from_dict(TrainRun, {"train": {"steps": "3"}})
  # Missing keys take their defaults.
  assert from_dict(TrainRun, {"job": "train"}) == TrainRun()


@pytest.mark.parametrize(
  "command, help_of",
  [
    (["run", "c.py"], ["run"]),
    (["uptrain", "--from", "a", "--workdir", "b", "--kv-heads", "1"], ["uptrain"]),
    (["bench", "decode"], ["bench", "decode"]),
  ],
)
def test_set_is_one_option_in_every_command(command, help_of, capsys):
  """--set takes several items and repeats, with the same help, wherever it is offered."""
  from kvjax.cli import main as cli
  from kvjax.cli.options import SET_HELP

  parser = cli.build_parser()
  args = parser.parse_args([*command, "--set", "a=1", "b.c=2", "--set", "d='x'"])
  assert args.overrides == ["a=1", "b.c=2", "d='x'"]
  assert parser.parse_args(command).overrides == []
  with pytest.raises(SystemExit):
    parser.parse_args([*help_of, "--help"])
  assert " ".join(capsys.readouterr().out.split()).count(" ".join(SET_HELP.split())) == 1


def test_a_cache_has_one_name_from_its_config():
  """kvjax.cache.config.cache_name: kvpress's names for presses and budgets, the codec after a
  "+", every other setting that differs from its default after a ","."""
  from kvjax.cache.config import CacheConfig, cache_name
  from kvjax.cache.presses import SnapKV, make_press

  cases = {
    "full": CacheConfig(),
    "full+int8": CacheConfig(dtype="int8"),
    "snapkv@0.5": CacheConfig(press=make_press("snapkv", compression_ratio=0.5)),
    "snapkv:adaptive+int8@0.5": CacheConfig(
      dtype="int8", press=make_press("snapkv", compression_ratio=0.5, heads="adaptive")
    ),
    "tova:pyramid@0.75": CacheConfig(press=make_press("tova", compression_ratio=0.75, layers="pyramid")),
    "full,layout=paged": CacheConfig(layout="paged"),
    "snapkv@0.75,press.window=32": CacheConfig(press=SnapKV(compression_ratio=0.75, window=32)),
    "full,window=[8],sink_tokens=4": CacheConfig(window=(8,), sink_tokens=4),
    "full+int4,rotation=hadamard": CacheConfig(dtype="int4", rotation="hadamard"),
    "knorm@0.5,press.decode_budget=16": CacheConfig(press=make_press("knorm", compression_ratio=0.5, decode_budget=16)),
  }
  assert {name: cache_name(config) for name, config in cases.items()} == {name: name for name in cases}
