"""A variant: one point of a KV-compression study, toy or pretrained. It names the params it runs
(the model as given, or a conversion of it, recovered or not) and the cache it decodes them
through (a CacheConfig: codec, window and sinks, press, any combination). The families are one
table (FAMILIES): adding a family is one entry there, then variants of it.

Cache choices are built here only (`cache`), so that a change in how CacheConfig holds them
(a press value in place of press fields) is one change.
"""

from __future__ import annotations

import dataclasses

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import PRESSES, make_press
from kvjax.conversion.conversions import KINDS, Conversion, KVHeads, ToMLA
from kvjax.fields import check_real, to_dict


@dataclasses.dataclass(frozen=True)
class Family:
  """A family of KV compression: the colour its points are drawn in, and the conversion kind
  ("heads", "mla") its variants' params are converted by, None when they run the model as given
  (a family of cache choices)."""

  colour: str
  conversion: str | None = None


FAMILIES: dict[str, Family] = {
  "full": Family("black"),
  "codec": Family("tab:blue"),
  "window": Family("tab:orange"),
  "press": Family("tab:green"),
  "heads": Family("tab:red", "heads"),
  "mla": Family("tab:purple", "mla"),
  "combined": Family("tab:brown"),
}
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def cache(
  dtype: str | None = None,
  window: int | tuple[int, ...] | None = None,
  sinks: int | None = None,
  press: str | None = None,
  ratio: float = 0.0,
) -> CacheConfig:
  """The CacheConfig of a variant: a codec, a sliding window on every layer (an int) or per layer
  (a tuple), sink tokens, a press at a compression ratio."""
  if isinstance(window, int):
    window = (window,)
  if press is None:
    return CacheConfig(dtype=dtype, window=window, sink_tokens=sinks)
  return CacheConfig(dtype=dtype, window=window, sink_tokens=sinks, press=make_press(press, compression_ratio=ratio))


@dataclasses.dataclass(frozen=True)
class Variant:
  """One point of a study: the params it runs decoded through a cache of `cache`.

  conversion: None runs the model as given; else its params converted by `conversion`
    (kvjax.conversion.conversions), recovered (`recovered`: the study's recovery, a toy study's
    uptraining at its alpha) or at alpha = 0.
  distill: the distillation weight of a toy study's uptraining.
  """

  name: str
  family: str
  cache: CacheConfig = CacheConfig()
  conversion: Conversion | None = None
  recovered: bool = False
  distill: float = 0.0

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.strip():
      raise ValueError(f"Variant.name must be a non-empty string, got {self.name!r}")
    if self.family not in FAMILIES:
      raise ValueError(f"Variant {self.name!r}: family must be one of {tuple(FAMILIES)}, got {self.family!r}")
    if not isinstance(self.cache, CacheConfig):
      raise ValueError(f"Variant {self.name!r}: cache must be a CacheConfig, got {self.cache!r}")
    if self.conversion is not None and not isinstance(self.conversion, KINDS):
      raise ValueError(f"Variant {self.name!r}: conversion must be a KVHeads or ToMLA, got {self.conversion!r}")
    kind = FAMILIES[self.family].conversion
    if kind is not None and getattr(self.conversion, "kind", None) != kind:
      raise ValueError(
        f"Variant {self.name!r}: family {self.family!r} runs params converted by a conversion of "
        f"that kind, got conversion={getattr(self.conversion, 'name', None)}"
      )
    if not isinstance(self.recovered, bool):
      raise ValueError(f"Variant {self.name!r}: recovered must be True or False, got {self.recovered!r}")
    if self.recovered and self.conversion is None:
      raise ValueError(f"Variant {self.name!r}: recovered=True needs a conversion to recover from")
    check_real(self, "distill", 0.0, 1e6)
    if self.distill and not self.recovered:
      raise ValueError(f"Variant {self.name!r}: distill={self.distill} needs a conversion to uptrain (recovered=True)")

  def describe(self) -> str:
    """The cache's choices that differ from the default, e.g. "dtype=int8, window=(32,)"; "full"
    without any."""
    default = to_dict(CacheConfig())
    changed = {k: v for k, v in to_dict(self.cache).items() if k != "press" and v != default[k]}
    if self.cache.press is not None:  # its layout follows from the press: the press names itself
      changed.pop("layout", None)
      press = self.cache.press
      settings = {k: v for k, v in to_dict(press).items() if k != "name" and v != to_dict(type(press)())[k]}
      changed["press"] = f"{press.name}({', '.join(f'{k}={v}' for k, v in settings.items())})"
    return ", ".join(f"{k}={v}" for k, v in changed.items()).replace("[", "(").replace("]", ",)") or "full"


def check_distinct(variants, where: str) -> None:
  """Refuses anything but a non-empty tuple of Variants with distinct names, naming `where`."""
  if not isinstance(variants, tuple) or not variants or not all(isinstance(v, Variant) for v in variants):
    raise ValueError(f"{where} must be a non-empty tuple of Variants, got {variants!r}")
  names = [v.name for v in variants]
  if len(set(names)) != len(names):
    raise ValueError(f"{where}: names must be distinct, got {names}")


def pareto(rows: list[dict], x: str, y: str, lower: bool = True) -> list[bool]:
  """Whether each row is on the Pareto front of (x, y): x lower-is-better, y lower-is-better (or
  higher with lower=False); no other row is at least as good on both and better on one."""
  sign = 1 if lower else -1

  def dominated(r):
    return any(o[x] <= r[x] and sign * o[y] <= sign * r[y] and (o[x] < r[x] or sign * o[y] < sign * r[y]) for o in rows)

  return [not dominated(r) for r in rows]


def toy_variants(
  gqa, windows: tuple[int, ...] = (), sinks: int = 4, dtypes=("float32", "bfloat16", "int8", "int4", "float8_e4m3fn")
) -> tuple[Variant, ...]:
  """The toy frontier's variants on a GQA study's MHA-big (a kvjax.studies.parts.gqa.GqaStudy): a cache
  of each of `dtypes`; every uptraining of the GQA study (gqa.uptrainings(): GQA and MQA
  mean-pooled, each of gqa.conversions with gqa.distill); each window in `windows` on every
  layer, without sinks and, when sinks > 0, with them."""
  out = [Variant(SHORT_DTYPES.get(d, d), "codec", cache(d)) for d in dtypes]
  for conversion, distill in gqa.uptrainings():
    label = gqa.model_name(conversion.target(gqa.big)).removesuffix("-big")
    tag = f"+distill{distill:g}" if distill else ""
    out.append(
      Variant(
        f"{label} {conversion.label}{tag}", conversion.kind, conversion=conversion, recovered=True, distill=distill
      )
    )
  for width in windows:
    out.append(Variant(f"window {width}", "window", cache(window=width)))
    if sinks:
      out.append(Variant(f"window {width} + {sinks} sinks", "window", cache(window=width, sinks=sinks)))
  return tuple(out)


def pretrained_variants(
  *,
  dtypes=("bfloat16", "float8_e4m3fn", "int8", "int4"),
  rotated=("int4",),
  kivi=("kivi2", "kivi4"),
  windows=(256,),
  sinks: int = 4,
  presses=tuple(PRESSES),
  ratios=(0.5, 0.75, 0.875),
  methods=("mean", "pca"),
  mla_rope_dims: tuple[int, int] = (48, 24),
  mla_recovered: tuple[bool, bool] = (True, True),
  head_dim: int = 64,
  num_kv_heads: int = 3,
  combined_press: str = "snapkv",
  combined_ratio: float = 0.5,
) -> tuple[Variant, ...]:
  """Every family on a pretrained model of num_kv_heads kv heads of head_dim: the full cache; each
  codec of `dtypes`, each of `rotated` also behind a Hadamard rotation (kvjax.cache.rotation),
  KIVI's layouts of `kivi`; each window without and with `sinks`; every press at every ratio; one kv
  head by each of `methods` at alpha = 0 and recovered; MLA at the bytes of the model's own kv
  heads and of one (rope dims mla_rope_dims), each recovered or at alpha = 0 (mla_recovered);
  int8 + combined_press at combined_ratio, and MQA (the last recovered method) + int8. Method
  "regroup" is left out by default: to one kv head there is one group, nothing to regroup, and it
  converts exactly as "pca"."""
  out = [Variant("full cache", "full")]
  out += [Variant(SHORT_DTYPES.get(d, d), "codec", cache(d)) for d in dtypes]
  out += [Variant(f"{d} + hadamard", "codec", CacheConfig(dtype=d, rotation="hadamard")) for d in rotated]
  out += [Variant(d, "codec", cache(d)) for d in kivi]
  for width in windows:
    out.append(Variant(f"window {width}", "window", cache(window=width, sinks=0)))
    if sinks:
      out.append(Variant(f"window {width} + {sinks} sinks", "window", cache(window=width, sinks=sinks)))
  out += [Variant(f"{p} {r:g}", "press", cache(press=p, ratio=r)) for p in presses for r in ratios]
  for method in methods:
    conversion = KVHeads(1, method)
    out.append(Variant(f"MQA {method}", "heads", conversion=conversion))
    out.append(Variant(f"MQA {method} + recovery", "heads", conversion=conversion, recovered=True))
  for heads, rope, recovered in zip((num_kv_heads, 1), mla_rope_dims, mla_recovered):
    rank = 2 * heads * head_dim - rope
    label = f"MLA {rank}+{rope} ({'GQA' if heads == num_kv_heads else 'MQA'} bytes)" + (
      " + recovery" if recovered else ""
    )
    out.append(Variant(label, "mla", conversion=ToMLA(rank, rope), recovered=recovered))
  out.append(
    Variant(
      f"int8 + {combined_press} {combined_ratio:g}",
      "combined",
      cache("int8", press=combined_press, ratio=combined_ratio),
    )
  )
  if methods:
    out.append(
      Variant(
        f"MQA {methods[-1]} + recovery + int8",
        "combined",
        cache("int8"),
        conversion=KVHeads(1, methods[-1]),
        recovered=True,
      )
    )
  return tuple(out)
