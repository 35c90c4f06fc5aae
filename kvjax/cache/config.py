"""CacheConfig: the runtime choices of a KV cache, apart from the network (ModelConfig).

The same trained model can be decoded through caches of several layouts and codecs; the
commands that decode take them as `--set cache.dtype=int8`, `--set cache.layout=paged`, ...
"""

from __future__ import annotations

import dataclasses

from kvjax.cache import codec as codecs, rotation as rotations
from kvjax.cache.presses import PRESSES, Press
from kvjax.fields import INT32_MAX, check_choice, check_nonnegative, check_positive, to_dict
from kvjax.config import ModelConfig
from kvjax.model.transformer import cache_payload

# The cache layouts by name: each layout module registers its class (`register`), so a new layout
# is one module; kvjax.cache.kinds imports them all.
LAYOUTS: dict[str, type] = {}
PAGED_READS = ("gather", "pallas", "pallas_interpret")
EVICTING = ("evict", "paged_evict")  # the layouts that take a press


def register(name: str):
  """Class decorator: the cache layout CacheConfig(layout=name) makes (KVCache.rows)."""

  def add(cls):
    LAYOUTS[name] = cls
    cls.layout = name
    return cls

  return add


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """How a KV cache stores what the model's attention hands it.

  layout: "contiguous" (each row preallocates its positions; a sliding-window layer keeps a ring
    of window + sinks slots), "paged" (page pools shared by the rows, kvjax.cache.layouts.paged) or
    "evict" (a press's budget of slots, kvjax.cache.layouts.evict) or "paged_evict" (a press's kept tokens
    in the engine's pages, kvjax.cache.layouts.paged_evict). Left None it is derived, here and
    nowhere else: "evict" with a press, "contiguous" without. A stated layout must agree with
    the press: "evict" needs one, and the other layouts keep every token.
  dtype: the codec (kvjax.cache.codec): a float dtype, "int8", "int4" or "float8_e4m3fn"; None
    stores the model's compute dtype. "kivi2" / "kivi4" are KIVI's 2- and 4-bit layout
    (kvjax.cache.layouts.kivi; layout "kivi", which an unset or "contiguous" layout becomes).
  page_size: tokens per page of a paged cache.
  paged_read: how a paged decode step reads its pages ("gather"; "pallas" is JAX's GPU kernel,
    "pallas_interpret" the same kernel interpreted on the CPU).
  window, sink_tokens: a sliding-window pattern and sinks to decode with in place of the model's
    (ModelConfig.window, sink_tokens; StreamingLLM on a model trained with full attention); None
    keeps the model's.
  absorb: an MLA model's cache is read in the absorbed form (kvjax.model.mla); False reads it
    expanded, the form the tests compare with.
  press: evict tokens by this press, a value with its own settings and compression ratio
    (kvjax.cache.presses: SnapKV(compression_ratio=0.75, window=64), StreamingLLM(sinks=4), ...;
    on the command line cache.press=snapkv cache.press.compression_ratio=0.75); None keeps
    every token.
  rotation: "hadamard" stores keys and values rotated by a normalized Walsh-Hadamard matrix over
    head_dim and reads them with rotated queries, the output turned back (kvjax.cache.rotation):
    the same attention, with each vector's outliers spread before the codec quantizes it; any
    codec and layout. None stores them as the model computes them.
  """

  layout: str | None = None
  dtype: str | None = None
  page_size: int = 16
  paged_read: str = "gather"
  window: tuple[int, ...] | None = None
  sink_tokens: int | None = None
  absorb: bool = True
  press: Press | None = None
  rotation: str | None = None

  def __post_init__(self):
    if self.press is not None and not isinstance(self.press, Press):
      raise ValueError(
        f"CacheConfig.press must be a press (kvjax.cache.presses: {', '.join(PRESSES)}) or None, got {self.press!r}"
      )
    if self.dtype in codecs.KIVI:
      if self.layout not in (None, "contiguous", "kivi") or self.press is not None:
        raise ValueError(
          f"CacheConfig.dtype={self.dtype!r} is KIVI's own layout (per-channel keys, a float residual), which "
          f"layout={self.layout!r} with press={self.press!r} cannot hold; leave the layout unset or 'contiguous', "
          "without a press"
        )
      object.__setattr__(self, "layout", "kivi")
    elif self.layout == "kivi":
      raise ValueError(f"CacheConfig.layout='kivi' stores {tuple(codecs.KIVI)} codes; set dtype to one of them")
    if self.layout is None:
      object.__setattr__(self, "layout", "contiguous" if self.press is None else "evict")
    # LAYOUTS fills as kvjax imports its layout modules (kvjax/__init__ imports them all); only the
    # default configs that those modules build while importing meet it empty.
    if LAYOUTS and self.layout not in LAYOUTS:
      raise ValueError(f"CacheConfig.layout must be one of {tuple(LAYOUTS)}, got {self.layout!r}")
    if self.dtype is not None:
      try:
        object.__setattr__(self, "dtype", codecs.codec(self.dtype).name)
      except ValueError:
        raise ValueError(
          f"CacheConfig.dtype must be one of {codecs.NAMES + tuple(codecs.KIVI)} or None, got {self.dtype!r}"
        ) from None
    if self.rotation is not None:
      check_choice(self, "rotation", rotations.ROTATIONS)
    check_positive(self, "page_size", most=INT32_MAX)
    check_choice(self, "paged_read", PAGED_READS)
    if self.paged_read != "gather" and (self.layout != "paged" or codecs.codec(self.dtype or "float32").quantized):
      raise ValueError(
        f"CacheConfig.paged_read={self.paged_read!r} reads float page pools only; use 'gather' "
        f"with layout={self.layout!r} and dtype={self.dtype!r}"
      )
    if self.window is not None:
      if not isinstance(self.window, (tuple, list)):
        raise ValueError(
          f"CacheConfig.window must be None or a tuple of per-layer window widths (0 = global), got {self.window!r}"
        )
      for i, width in enumerate(self.window):  # whether they fit a model is CacheConfig.model's to say
        if isinstance(width, bool) or not isinstance(width, int) or not 0 <= width <= INT32_MAX:
          raise ValueError(
            f"CacheConfig.window[{i}] must be a non-negative integer (0 = global) up to {INT32_MAX:,}, got {width!r}"
          )
      object.__setattr__(self, "window", tuple(self.window))
    if self.sink_tokens is not None:
      check_nonnegative(self, "sink_tokens", most=INT32_MAX)
    if not isinstance(self.absorb, bool):
      raise ValueError(f"CacheConfig.absorb must be True or False, got {self.absorb!r}")
    if self.layout in EVICTING and self.press is None:
      raise ValueError(
        f"CacheConfig.layout={self.layout!r} needs a press, CacheConfig.press (cache.press=NAME): one of {tuple(PRESSES)}"
      )
    if self.layout not in EVICTING and self.press is not None:
      raise ValueError(
        f"CacheConfig.press={self.press!r} evicts tokens, which layout={self.layout!r} does not (it keeps every "
        "token); leave the layout unset (a press makes it 'evict') or set it to 'evict' (or 'paged_evict', the engine's)"
      )
    if self.rotation is not None and self.press is not None and self.press.reads_channels:
      raise ValueError(
        f"CacheConfig.press={self.press.name!r} reads key and query channels through RoPE's frequencies, which "
        f"CacheConfig.rotation={self.rotation!r} mixes; use rotation=None with this press"
      )

  def codec(self, config: ModelConfig) -> codecs.Codec:
    """The codec of a cache for a model of `config`; ValueError when its vectors cannot take it."""
    codec = codecs.codec(self.dtype or config.dtype)
    for name, field in cache_payload(config).items():
      codec.check_width(field.width, f"the model's cached {name}")
    if self.rotation is not None:
      payload = cache_payload(config)
      if set(payload) != {"k", "v"}:
        raise ValueError(
          f"CacheConfig.rotation={self.rotation!r} rotates keys and values with their queries; this model "
          f"caches {sorted(payload)} (an MLA latent is read through absorbed projections), use rotation=None"
        )
      rotations.check_width(config.head_dim, "the model's head_dim")
    return codec

  def model(self, config: ModelConfig) -> ModelConfig:
    """`config` with this cache's window and sinks, the masks its decoding keeps; ValueError when
    the model cannot take them."""
    window = config.window if self.window is None else self.window
    sinks = config.sink_tokens if self.sink_tokens is None else self.sink_tokens
    if (window, sinks) == (config.window, config.sink_tokens):
      return config
    if window != config.window and config.rope_local_theta is not None:
      raise ValueError(
        f"CacheConfig.window={self.window}: the model's windowed layers turn RoPE at their own base "
        f"(ModelConfig.rope_local_theta={config.rope_local_theta}), so its window pattern {config.window} stays; use window=None"
      )
    try:
      return config.replace(window=window, sink_tokens=sinks)
    except ValueError as e:
      raise ValueError(
        f"CacheConfig.window={self.window}, sink_tokens={self.sink_tokens} do not fit the model: {e}"
      ) from None

  @property
  def prefill_chunk(self) -> int:
    """Columns per call a prompt is prefilled in (the press's prefill_chunk; 0: one call)."""
    return self.press.prefill_chunk if self.press is not None else 0

  def replace(self, **changes) -> "CacheConfig":
    return dataclasses.replace(self, **changes)

  def bind(self, tokenizer) -> "CacheConfig":
    """This config with its press bound to a model's tokenizer (Press.bind: KVzip's repeat
    prompt in the model's ids), as every command and study does once it has loaded a model and
    its tokenizer (None: a model without one); a config without a press is returned as it is."""
    return self if self.press is None else self.replace(press=self.press.bind(tokenizer))


BUDGET = ("compression_ratio", "heads", "layers")  # the press fields a cache's name spells out


def cache_name(cache_config: CacheConfig) -> str:
  """The one name of a cache, the same in tables, records and peer comparisons: "full" for a
  cache that keeps every token, else "<press>@<compression ratio>", the press "<name>:adaptive"
  under AdaKV's head-adaptive budgets, "<name>:pyramid" under PyramidKV's per-layer ones (kvpress's
  names: experiments/kvpress_reference.py); a codec other than the model's own follows as
  "+<dtype>" ("full+int8", "snapkv+int8@0.5"); every other setting that differs from its default
  follows as ",field=value" ("full,layout=paged", "snapkv@0.5,press.window=32"). Name a
  cache before a tokenizer binds its prompts into it (CacheConfig.bind)."""
  press = cache_config.press
  codec = f"+{cache_config.dtype}" if cache_config.dtype else ""
  if press is None:
    name, changed = f"full{codec}", {}
  else:
    heads = ":adaptive" if press.heads == "adaptive" else ""
    layers = ":pyramid" if press.layers == "pyramid" else ""
    name = f"{press.name}{heads}{layers}{codec}@{press.compression_ratio:g}"
    changed = {
      f"press.{f.name}": getattr(press, f.name)
      for f in dataclasses.fields(press)
      if f.init and f.name not in BUDGET and getattr(press, f.name) != f.default
    }
  plain = to_dict(CacheConfig(dtype=cache_config.dtype, press=press))  # the layout it derives
  given = to_dict(cache_config)
  changed |= {k: v for k, v in given.items() if k not in ("press", "dtype") and v != plain[k]}
  return ",".join([name, *(f"{k}={v}" for k, v in changed.items())])
