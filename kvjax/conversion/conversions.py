"""Conversions as values: what a checkpoint becomes, how, and a short name for its files.

A conversion is a frozen dataclass with
  name               a short name for folders and stage names ("kv2_mean", "mla_r32_rope8")
  label              the way of converting, for table rows and figure legends ("mean", "32+8")
  kind               the family of caches it gives: "heads" (fewer kv heads) or "mla"
  needs_calibration  whether convert reads calibration tokens
  target(config)     the ModelConfig the converted model has, or a ValueError naming the field
                     that does not fit; checked before anything is loaded or computed
  convert(params, config, calibration) -> (params, config), a pure function of its inputs.
KVHeads regroups kv heads (kvjax.conversion.kv_heads: mean, first, random, pca, regroup); ToMLA
converts to multi-head latent attention (kvjax.conversion.mla). `Conversion` is the annotation a
config field holding one uses: kvjax.fields.from_dict reads either back from its dict (to_dict)
by its keys, so a study, a marker and a record all store a conversion the same way.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from kvjax.config import ModelConfig
from kvjax.fields import check_choice, check_nonnegative, check_positive, from_dict
from kvjax.conversion.kv_heads import METHODS, convert_kv_heads
from kvjax.conversion.mla import FACTORISATIONS, check_target, convert_to_mla

CALIBRATED_METHODS = ("pca", "regroup")


@dataclasses.dataclass(frozen=True)
class KVHeads:
  """MHA / GQA -> `num_kv_heads` kv heads (a divisor of the source's) by `method`; `seed` seeds
  method "random" only."""

  num_kv_heads: int
  method: str = "mean"
  seed: int = 0
  kind: ClassVar[str] = "heads"

  def __post_init__(self):
    check_positive(self, "num_kv_heads")
    check_choice(self, "method", METHODS)
    check_nonnegative(self, "seed")
    if self.seed and self.method != "random":
      raise ValueError(f"KVHeads.seed={self.seed} seeds method='random' only, not method={self.method!r}")

  @property
  def name(self) -> str:
    return f"kv{self.num_kv_heads}_{self.method}" + (f"_seed{self.seed}" if self.seed else "")

  @property
  def label(self) -> str:
    return self.method

  @property
  def needs_calibration(self) -> bool:
    return self.method in CALIBRATED_METHODS

  def target(self, config: ModelConfig) -> ModelConfig:
    if config.is_latent:
      raise ValueError(
        f"KVHeads: the model is MLA (kv_latent_rank={config.kv_latent_rank}); its kv heads are "
        "rotary groups of one latent and do not regroup"
      )
    if config.num_kv_heads % self.num_kv_heads:
      raise ValueError(
        f"KVHeads.num_kv_heads={self.num_kv_heads}: cannot convert {config.num_kv_heads} kv heads "
        f"to {self.num_kv_heads}: the target must divide the current number of kv heads "
        f"({config.num_kv_heads})"
      )
    return config.replace(num_kv_heads=self.num_kv_heads)

  def convert(self, params, config: ModelConfig, calibration=None):
    """(params, config) with num_kv_heads kv heads; calibration int[B, T] tokens for pca / regroup."""
    self.target(config)
    return convert_kv_heads(
      params, config, self.num_kv_heads, self.method, rng=jax.random.key(self.seed), calibration=calibration
    )


@dataclasses.dataclass(frozen=True)
class ToMLA:
  """MHA / GQA -> multi-head latent attention with latent rank `kv_latent_rank` and a shared
  rotary key of `rope_dims` dims (kvjax.conversion.mla; always calibrated)."""

  kv_latent_rank: int
  rope_dims: int
  factorisation: str = "activation"
  kind: ClassVar[str] = "mla"

  def __post_init__(self):
    check_positive(self, "kv_latent_rank")
    check_nonnegative(self, "rope_dims")
    check_choice(self, "factorisation", FACTORISATIONS)

  @classmethod
  def at_kv_heads(cls, config: ModelConfig, num_kv_heads: int, rope_dims: int) -> ToMLA:
    """The conversion of `config` whose cache holds exactly the bytes per token of `config` with
    num_kv_heads kv heads: per layer rank + rope_dims = 2 x num_kv_heads x head_dim. ValueError
    when rope_dims leaves no latent."""
    rank = 2 * num_kv_heads * config.head_dim - rope_dims
    if rank <= 0:
      raise ValueError(
        f"rope_dims={rope_dims} leaves no latent at the bytes of {num_kv_heads} kv heads "
        f"(2 x {num_kv_heads} x head_dim={config.head_dim} = {2 * num_kv_heads * config.head_dim} "
        "per layer)"
      )
    return cls(rank, rope_dims)

  @property
  def name(self) -> str:
    suffix = "" if self.factorisation == "activation" else f"_{self.factorisation}"
    return f"mla_r{self.kv_latent_rank}_rope{self.rope_dims}{suffix}"

  @property
  def label(self) -> str:
    return f"{self.kv_latent_rank}+{self.rope_dims}" + ("" if self.factorisation == "activation" else " svd")

  @property
  def needs_calibration(self) -> bool:
    return True

  def target(self, config: ModelConfig) -> ModelConfig:
    """The MLA config; its rope_pairs (which frequencies each group keeps) are the conversion's
    choice from the calibration tokens, left None here."""
    check_target(config, self.kv_latent_rank, self.rope_dims)
    return config.replace(kv_latent_rank=self.kv_latent_rank, rope_dims=self.rope_dims)

  def convert(self, params, config: ModelConfig, calibration=None):
    """(params, config) of the MLA model; calibration int[B, T] tokens score the frequencies and
    weight the factorisation."""
    return convert_to_mla(
      params, config, self.kv_latent_rank, self.rope_dims, calibration=calibration, factorisation=self.factorisation
    )


Conversion = KVHeads | ToMLA
KINDS = (KVHeads, ToMLA)


def from_record(data: dict) -> Conversion:
  """A conversion from its dict (kvjax.fields.to_dict of it), the kind told by its keys; a
  ValueError naming the keys of each kind when it is none of them."""
  if not isinstance(data, dict):
    raise ValueError(f"a conversion is a dict of its fields, got {data!r}")
  for cls in KINDS:
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    if required <= set(data) <= names:
      return from_dict(cls, data)
  kinds = "; ".join(f"{cls.__name__}: {', '.join(f.name for f in dataclasses.fields(cls))}" for cls in KINDS)
  raise ValueError(f"{data!r} is not a conversion; the keys of each kind are {kinds}")
