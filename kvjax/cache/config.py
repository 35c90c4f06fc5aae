"""CacheConfig: the runtime choices of a KV cache, apart from the network (ModelConfig).

The same trained model can be decoded through caches of several layouts and codecs; the
commands that decode take them as `--set cache.dtype=int8`, `--set cache.layout=paged`, ...
"""

from __future__ import annotations

import dataclasses

from kvjax.cache import codec as codecs
from kvjax.cache.presses import PRESSES
from kvjax.fields import INT32_MAX, check_choice, check_nonnegative, check_positive
from kvjax.config import ModelConfig
from kvjax.model.transformer import cache_payload

# The cache layouts by name: each layout module registers its class (`register`), so a new layout
# is one module; kvjax.cache.kinds imports them all.
LAYOUTS: dict[str, type] = {}
PAGED_READS = ("gather", "pallas", "pallas_interpret")


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
    of window + sinks slots) or "paged" (page pools shared by the rows, kvjax.cache.paged).
  dtype: the codec (kvjax.cache.codec): a float dtype, "int8", "int4" or "float8_e4m3fn"; None
    stores the model's compute dtype.
  page_size: tokens per page of a paged cache.
  paged_read: how a paged decode step reads its pages ("gather"; "pallas" is JAX's GPU kernel,
    "pallas_interpret" the same kernel interpreted on the CPU).
  window, sink_tokens: a sliding-window pattern and sinks to decode with in place of the model's
    (ModelConfig.window, sink_tokens; StreamingLLM on a model trained with full attention); None
    keeps the model's.
  absorb: an MLA model's cache is read in the absorbed form (kvjax.model.mla); False reads it
    expanded, the form the tests compare with.
  press: evict tokens by this press (kvjax.cache.presses: "streaming_llm", "snapkv", "tova",
    "observed", "knorm", "random"); it makes the layout "evict" (kvjax.cache.evict).
  compression_ratio: the fraction of a prompt's tokens the press drops, in [0, 1).
  press_window, press_kernel: SnapKV's observation window (the prompt's last queries) and the
    width of its average pool (odd).
  press_sinks: the first tokens StreamingLLM always keeps.
  press_seed: the random press's seed.
  press_heads: "uniform" (every kv head keeps as many tokens) or "adaptive" (AdaKV: the row's
    budget goes to its heads' best tokens together, each head first keeping press_safeguard of
    its share; kvjax.cache.evict.head_budgets).
  """

  layout: str = "contiguous"
  dtype: str | None = None
  page_size: int = 16
  paged_read: str = "gather"
  window: tuple[int, ...] | None = None
  sink_tokens: int | None = None
  absorb: bool = True
  press: str | None = None
  compression_ratio: float = 0.0
  press_window: int = 64
  press_kernel: int = 5
  press_sinks: int = 4
  press_seed: int = 0
  press_heads: str = "uniform"
  press_safeguard: float = 0.2

  def __post_init__(self):
    # LAYOUTS fills as kvjax imports its layout modules (kvjax/__init__ imports them all); only the
    # default configs that those modules build while importing meet it empty.
    if LAYOUTS and self.layout not in LAYOUTS:
      raise ValueError(f"CacheConfig.layout must be one of {tuple(LAYOUTS)}, got {self.layout!r}")
    if self.dtype is not None:
      try:
        object.__setattr__(self, "dtype", codecs.codec(self.dtype).name)
      except ValueError:
        raise ValueError(f"CacheConfig.dtype must be one of {codecs.NAMES} or None, got {self.dtype!r}") from None
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
    self._check_press()

  def _check_press(self):
    ratio = self.compression_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
      raise ValueError(f"CacheConfig.compression_ratio must be a number in [0, 1), got {ratio!r}")
    object.__setattr__(self, "compression_ratio", float(ratio))
    for name in ("press_window", "press_kernel"):
      check_positive(self, name, most=INT32_MAX)
    check_nonnegative(self, "press_sinks", most=INT32_MAX)
    check_nonnegative(self, "press_seed", most=INT32_MAX)
    check_choice(self, "press_heads", ("uniform", "adaptive"))
    safeguard = self.press_safeguard
    if isinstance(safeguard, bool) or not isinstance(safeguard, (int, float)) or not 0 <= safeguard <= 1:
      raise ValueError(f"CacheConfig.press_safeguard must be a number in [0, 1], got {safeguard!r}")
    if self.press_kernel % 2 == 0:
      raise ValueError(f"CacheConfig.press_kernel must be odd (a centred pool), got {self.press_kernel}")
    if self.press is None:
      if self.layout == "evict":
        raise ValueError(f"CacheConfig.layout='evict' needs a press: one of {tuple(PRESSES)}")
      if ratio:
        raise ValueError(f"CacheConfig.compression_ratio={ratio} needs a press: one of {tuple(PRESSES)}")
      return
    if self.press not in PRESSES:
      raise ValueError(f"CacheConfig.press must be one of {tuple(PRESSES)} or None, got {self.press!r}")
    if self.layout == "contiguous":
      object.__setattr__(self, "layout", "evict")
    elif self.layout != "evict":
      raise ValueError(
        f"CacheConfig.press={self.press!r} needs the evicting layout; layout={self.layout!r} keeps every token "
        "(a paged cache does not evict)"
      )

  def make_press(self):
    """The press value this config names (kvjax.cache.presses)."""
    if self.press is None:
      raise ValueError(f"CacheConfig.layout={self.layout!r} needs a press: one of {tuple(PRESSES)}")
    settings = {"press_window": "window", "press_kernel": "kernel", "press_sinks": "sinks", "press_seed": "seed"}
    cls = PRESSES[self.press]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{mine: getattr(self, ours) for ours, mine in settings.items() if mine in fields})

  def codec(self, config: ModelConfig) -> codecs.Codec:
    """The codec of a cache for a model of `config`; ValueError when its vectors cannot take it."""
    codec = codecs.codec(self.dtype or config.dtype)
    for name, field in cache_payload(config).items():
      codec.check_width(field.width, f"the model's cached {name}")
    return codec

  def model(self, config: ModelConfig) -> ModelConfig:
    """`config` with this cache's window and sinks, the masks its decoding keeps; ValueError when
    the model cannot take them."""
    window = config.window if self.window is None else self.window
    sinks = config.sink_tokens if self.sink_tokens is None else self.sink_tokens
    if (window, sinks) == (config.window, config.sink_tokens):
      return config
    try:
      return config.replace(window=window, sink_tokens=sinks)
    except ValueError as e:
      raise ValueError(
        f"CacheConfig.window={self.window}, sink_tokens={self.sink_tokens} do not fit the model: {e}"
      ) from None

  def replace(self, **changes) -> "CacheConfig":
    return dataclasses.replace(self, **changes)
