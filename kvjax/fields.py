"""Config fields: the checks every config's __post_init__ uses, and the generic machinery
(to_dict, from_dict, apply_overrides) that works for any nested frozen-dataclass config.

A field may hold one of a family of values chosen by name (`Named`: the presses of
kvjax.cache.presses): it is set by name, `--set cache.press=snapkv`, then field by field like any
nested config, `--set cache.press.window=32`; to_dict writes the name beside the fields.

Run configs (kvjax.training.config.TrainRun and the run configs of other jobs) nest these
dataclasses and carry a `job` field naming what `kvjax run` executes.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, Sequence


# The largest size or count a config may hold where it reaches JAX (shapes, positions, step
# counts): JAX indexes in int32 unless x64 is on, so a larger one is refused here rather than
# overflowing when it is traced.
INT32_MAX = 2**31 - 1
# The largest seed: jax.random.key and numpy's generators take a signed 64-bit integer.
SEED_MAX = 2**63 - 1


def check_positive_int(value: Any, name: str, most: int | None = None) -> None:
  """Raises ValueError naming `name` unless `value` is an int >= 1 (bools are not ints here),
  and at most `most` when given."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  _check_most(value, name, most)


def _check_most(value: int, name: str, most: int | None) -> None:
  if most is not None and value > most:
    raise ValueError(f"{name} must be at most {most:,}, got {value!r}")


def check_positive(obj: Any, *names: str, most: int | None = None) -> None:
  """Raises ValueError naming the first field of `obj` that is not a positive int (at most `most`)."""
  for name in names:
    check_positive_int(getattr(obj, name), f"{type(obj).__name__}.{name}", most)


def check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
  value = getattr(obj, name)
  if value not in choices:
    raise ValueError(f"{type(obj).__name__}.{name} must be one of {choices}, got {value!r}")


def check_nonnegative(obj: Any, *names: str, most: int | None = None) -> None:
  """Raises ValueError naming the first field of `obj` that is not an int >= 0 (at most `most`)."""
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{type(obj).__name__}.{name} must be a non-negative integer, got {value!r}")
    _check_most(value, f"{type(obj).__name__}.{name}", most)


def check_real(
  obj: Any, name: str, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> None:
  """Raises ValueError unless field `name` is a real number in [low, high] (ends optionally open)."""
  value = getattr(obj, name)
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
  if not ok:
    interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    raise ValueError(f"{type(obj).__name__}.{name} must be a finite number in {interval}, got {value!r}")


# Generic machinery for any nested frozen-dataclass config (TrainRun and other jobs' run configs).


class Named:
  """The base of a family of frozen-dataclass values chosen by name. The family's root declares
  its own `kinds: ClassVar[dict] = {}`; each subclass that sets `name` in its body is entered there
  by its class definition, so adding a kind is one class. A config field annotated with the root
  (or the root | None) takes an instance, a kind's name (that kind with its defaults) or a dict
  {"name": NAME, FIELD: VALUE, ...}, which is what to_dict writes."""

  name: ClassVar[str] = ""
  kinds: ClassVar[dict[str, type]] = {}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "kinds" in vars(cls) or "name" not in vars(cls):  # a family's root, or a kind's shared base
      return
    if cls.kinds.get(cls.name, cls) is not cls:
      raise TypeError(f"{cls.__name__}: the name {cls.name!r} is {cls.kinds[cls.name].__name__}'s already")
    cls.kinds[cls.name] = cls

  @classmethod
  def family(cls) -> str:
    """The family's name for messages: its root class's, lower case ("press")."""
    return next(c for c in cls.__mro__ if "kinds" in vars(c)).__name__.lower()

  @classmethod
  def choose(cls, value: Any, where: str) -> "Named":
    """`value` (an instance, a kind's name, or a dict with its "name" and fields) as an instance of
    this family; ValueError naming `where` and the kinds or fields it may take."""
    if isinstance(value, cls):
      return value
    names = ", ".join(cls.kinds)
    if isinstance(value, str):
      name, fields = value, {}
    elif isinstance(value, dict) and isinstance(value.get("name"), str):
      name, fields = value["name"], {k: v for k, v in value.items() if k != "name"}
    else:
      raise ValueError(f"{where} expects a {cls.family()} by name ({names}) or a dict with its 'name', got {value!r}")
    kind = cls.kinds.get(name)
    if kind is None or not issubclass(kind, cls):
      raise ValueError(f"{where}: unknown {cls.family()} {name!r}; valid: {names}")
    try:
      return from_dict(kind, fields)
    except ValueError as err:
      raise ValueError(f"{where}: {err}") from None


def _is_named(tp: Any) -> bool:
  return isinstance(tp, type) and issubclass(tp, Named)


def _named_family(tp: Any) -> type | None:
  """The Named family an annotation (Family or Family | None) takes, else None."""
  args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
  return next((a for a in args if _is_named(a)), None)


def to_dict(config: Any) -> dict:
  """Nested dataclass -> dict of JSON types (tuples become lists)."""

  def plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
      return {"name": value.name} | fields if isinstance(value, Named) else fields
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [plain(v) for v in value]
    return value

  return plain(config)


def from_dict(cls: type, data: dict) -> Any:
  """Inverse of to_dict: builds `cls` (nested dataclasses, tuples) and so re-runs validation.
  Missing keys take their defaults; unknown keys raise ValueError."""
  if not isinstance(data, dict):
    raise ValueError(f"{cls.__name__} expects a dict, got {data!r}")
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(data) - set(names))
  if unknown:
    raise ValueError(f"unknown {cls.__name__} keys {unknown}; valid keys: {', '.join(names)}")
  hints = typing.get_type_hints(cls)
  return cls(**{k: _coerce(hints[k], v, f"{cls.__name__}.{k}") for k, v in data.items()})


def config_keys(config: Any, prefix: str = "") -> list[str]:
  """Dotted names of every leaf field, e.g. ['job', 'model.d_model', ...]."""
  keys = []
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value):
      keys += config_keys(value, f"{prefix}{f.name}.")
    elif f.init:
      keys.append(f"{prefix}{f.name}")
  return keys


def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
  """Applies "section.field=value" strings to a nested frozen dataclass, re-validating each level.

  Values are Python literals (ast.literal_eval); anything that does not parse is taken as a
  string, so `data.source=/tmp/a.txt` works. Fields left at a default derived in __post_init__
  (None resolved there, such as ModelConfig.head_dim) are derived again from the new values.
  Raises ValueError on a malformed item, an unknown key (listing the valid ones) or a wrong type.
  """
  for item in overrides:
    key, sep, text = item.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key:
      raise ValueError(f"override {item!r} is not of the form key=value")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    try:
      config = _replace_path(config, key.split("."), value, key)
    except KeyError:
      raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(config_keys(config))}") from None
  return config


def _replace_path(obj: Any, parts: list[str], value: Any, key: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(obj) if f.init}
  if parts[0] not in fields:
    raise KeyError(key)
  current = getattr(obj, parts[0])
  if len(parts) > 1:
    family = _named_family(typing.get_type_hints(type(obj))[parts[0]]) if current is None else None
    if family is not None:
      field = key[: len(key) - len(".".join(parts[1:])) - 1]
      raise ValueError(
        f"{key}: {field} is None; choose the {family.family()} first, {field}=NAME ({', '.join(family.kinds)})"
      )
    if not dataclasses.is_dataclass(current):
      raise KeyError(key)
    new = _replace_path(current, parts[1:], value, key)
  else:
    hint = typing.get_type_hints(type(obj))[parts[0]]
    if dataclasses.is_dataclass(current) and _named_family(hint) is None:  # a section is set field by field
      raise KeyError(key)
    new = _coerce(hint, value, key)
  return _rebuild(obj, parts[0], new)


def _rebuild(obj: Any, name: str, value: Any) -> Any:
  kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
  for f in dataclasses.fields(obj):
    if f.init and f.default is None and f.name != name:
      try:
        derived = getattr(dataclasses.replace(obj, **{f.name: None}), f.name)
      except ValueError:
        continue
      if derived == kwargs[f.name]:
        kwargs[f.name] = None
  kwargs[name] = value
  return type(obj)(**kwargs)


def _type_name(tp: Any) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
  """Checks `value` against annotation `tp`; returns it converted (int -> float, list -> tuple,
  dict -> dataclass). Raises ValueError naming `where`."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if tp is Any:
    return value
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    refusals = []  # what each dataclass of the union said of a dict: its own check names the field
    for arg in args:
      if _is_named(arg):  # a family chosen by name says itself what it takes
        return _coerce(arg, value, where)
      if arg is not type(None):
        try:
          return _coerce(arg, value, where)
        except ValueError as err:
          if dataclasses.is_dataclass(arg) and isinstance(value, dict):
            refusals.append(str(err))
    if refusals:
      raise ValueError(f"{where}: {' / '.join(refusals)}")
  elif origin is typing.Literal:
    if value in args:
      return value
  elif _is_named(tp):
    return tp.choose(value, where)
  elif dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if isinstance(value, dict):
      return from_dict(tp, value)
  elif origin in (tuple, list) and isinstance(value, (list, tuple)):
    if origin is tuple and args and args[-1] is not Ellipsis:
      if len(args) == len(value):
        return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    else:
      items = [_coerce(args[0], v, f"{where}[{i}]") if args else v for i, v in enumerate(value)]
      return tuple(items) if origin is tuple else items
  elif origin is dict:
    if isinstance(value, dict):
      return value
  elif tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif isinstance(tp, type) and isinstance(value, tp):
    return value
  raise ValueError(f"{where} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")
