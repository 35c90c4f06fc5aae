"""The base of every press (kvjax.cache.presses): its budgets and fields, the scores it is asked
for, the causal attention weights the attention presses read, and the registry."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.fields import INT32_MAX, Named, check_choice, check_nonnegative, check_positive, check_real
from kvjax.model.attention import take_rows
from kvjax.model.keys import NEG_INF, group_queries
from kvjax.model.rope import Rope

# Arrivals of an attention press score RECENT + position: above every attention weight (at most 1,
# 2 for the always-kept tokens) and exact in float32 for positions below 2**22.
RECENT = float(2**22)


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array, transposed: bool = False) -> jax.Array:
  """Softmax attention weights of queries over keys, zero where a query does not read a key.

  Args:
    q: [B, W, N, H] the queries (rotated); k: [B, K, S, H] the keys ([B, K, H, S] if `transposed`).
    mask: bool [B, K or 1, W, S], which key each query reads (a query reading none: zeros).
  Returns:
    float32 [B, K, G, W, S].
  """
  h = q.shape[-1]
  queries = group_queries(q, k.shape[1]) * h**-0.5  # [B, W, K, G, H]
  spec = "bwkgh,bkhs->bkgws" if transposed else "bwkgh,bksh->bkgws"
  scores = jnp.einsum(spec, queries, k.astype(q.dtype), preferred_element_type=jnp.float32)
  weights = jax.nn.softmax(jnp.where(mask[:, :, None], scores, NEG_INF), axis=-1)
  return jnp.where(mask[:, :, None], weights, 0.0)


def causal_weights(q: jax.Array, k: jax.Array, columns: jax.Array, lengths: jax.Array) -> jax.Array:
  """Causal attention weights (attention_weights) of a prompt's queries at `columns` int[B, W]
  (negative: none, zero weights) over its keys k [B, K, T, H], q [B, T, N, H] every column's; keys
  past lengths int[B] are padding. -> float32 [B, K, G, W, T]."""
  keys = jnp.arange(k.shape[2])
  seen = (keys[None, None, :] <= columns[:, :, None]) & (keys[None, None, :] < lengths[:, None, None])  # [B, W, T]
  seen &= (columns >= 0)[:, :, None]
  return attention_weights(take_rows(q, jnp.maximum(columns, 0)), k, seen[:, None])


def kept(lengths, ratio: float) -> np.ndarray:
  """Tokens a press keeps of prompts of `lengths` (ints or an int array): int(n * (1 - ratio)),
  in float64 as Python computes it (host side; a traced length indexes a table of it)."""
  return (np.asarray(lengths, np.float64) * (1 - ratio)).astype(np.int64)


HEADS = ("uniform", "adaptive")
LAYERS = ("uniform", "pyramid")


@dataclasses.dataclass(frozen=True)
class Press(Named):
  """A scoring rule and how much it drops (module docstring). Subclasses set `name` and `scores`."""

  compression_ratio: float = 0.0
  heads: str = "uniform"
  safeguard: float = 0.2
  layers: str = "uniform"
  beta: int = 20
  decode_budget: int = 0
  decode_interval: int = 1
  prefill_chunk: int = 0
  kinds: ClassVar[dict[str, type[Press]]] = {}

  def __post_init__(self):
    check_real(self, "compression_ratio", 0, 1, open_high=True)
    object.__setattr__(self, "compression_ratio", float(self.compression_ratio))
    check_choice(self, "heads", HEADS)
    check_real(self, "safeguard", 0, 1)
    object.__setattr__(self, "safeguard", float(self.safeguard))
    check_choice(self, "layers", LAYERS)
    check_positive(self, "beta", most=INT32_MAX)
    check_nonnegative(self, "decode_budget", "prefill_chunk", most=INT32_MAX)
    check_positive(self, "decode_interval", most=INT32_MAX)
    if self.prefill_chunk and not self.decode_budget:
      raise ValueError(
        f"{type(self).__name__}.prefill_chunk={self.prefill_chunk} needs a decode_budget (the tokens each chunk is pressed into)"
      )
    if self.decode_budget and self.heads == "adaptive":
      raise ValueError(
        f"{type(self).__name__}.decode_budget={self.decode_budget} presses every head to the same budget; "
        "heads='adaptive' (AdaKV) budgets only the prompt"
      )

  @property
  def scoring(self) -> Press:
    """This press with its budgets (compression ratio, heads, layers, decode budget) at their
    defaults: two presses with the same `scoring` score a prompt alike, so one scoring serves every
    ratio and budget of it (kvjax.cache.layouts.fanout)."""
    return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(Press)})

  @property
  def headroom(self) -> int:
    """Slots above decode_budget: the most tokens a row takes between two pressings."""
    return max(self.decode_interval, self.prefill_chunk) if self.decode_budget else 0

  @property
  def reads_attention(self) -> bool:
    """Whether held_scores reads the call's attention weights (a decode-time rule under a budget)."""
    return False

  def held_scores(self, scores: jax.Array, weights: jax.Array, valid: jax.Array, new: jax.Array) -> jax.Array:
    """The scores of a row's held slots after a call under a decode budget: scores [B, K, S] as
    held, weights float32 [B, K, G, T, S] of the call's queries over the slots (zero for padding
    columns), valid bool[B, T] the call's real columns, new bool[B, K, S] the slots this call wrote."""
    return scores

  @property
  def min_slots(self) -> int:
    """The tokens this press always keeps (SnapKV's window, StreamingLLM's sinks): a row's slots
    may not be fewer."""
    return 0

  @property
  def storage_ratio(self) -> float:
    """The fraction of a prompt the evicting cache's slots leave out (kvjax.cache.layouts.evict.slots_for):
    the compression ratio, unless a press's heads may keep more than an even share."""
    return self.compression_ratio

  def most_kept(self, n: int) -> int:
    """The most tokens of an n-token prompt one head may keep: what the evicting cache's slots hold."""
    return int(kept(n, self.storage_ratio))

  @property
  def grouped(self) -> bool:
    """Whether the press keeps tokens in groups (`regroup`), so that how many it keeps depends on
    its scores."""
    return False

  def regroup(self, scores: jax.Array, lengths: jax.Array):
    """For a press that keeps tokens in groups (ChunkKV's chunks): (scores float32 [B, K, T], every
    token of a kept group above every other, counts int[B, K]: the tokens each head keeps) from its
    scores (-inf: padding) of prompts of lengths int[B]; None (the default): each token on its own,
    under the press's budget (kvjax.cache.selection)."""
    return None

  @property
  def model_level(self) -> bool:
    """Whether the press scores a prompt in a pass of the whole model (KVzip's reconstruction)
    rather than inside each layer: an evicting cache's first call then runs `prefill`
    (KVCache.first_call)."""
    return False

  def prefill(self, model, params, cache, tokens: jax.Array, lengths: jax.Array, logits_at=None):
    """A model-level press's first call into the empty evicting cache `cache`: right-padded
    prompts tokens int32[B, T], lengths int32[B] -> (logits as the Transformer returns them at
    logits_at, the pressed cache). Traced."""
    raise NotImplementedError(f"{type(self).__name__} scores inside each layer; it has no model-level prefill")

  def bind(self, tokenizer) -> Press:
    """This press with whatever it reads in a model's own tokens taken from `tokenizer` (KVzip's
    repeat prompt); most presses read none and return themselves (CacheConfig.bind)."""
    return self

  def check_prompt(self, vocab_size: int) -> None:
    """Raises ValueError unless the token ids this press holds (bind's) fit a vocabulary of vocab_size."""

  @property
  def uneven_heads(self) -> bool:
    """Whether heads of a row may keep different numbers of a prompt's tokens (the evicting cache
    then reads by positions)."""
    return self.heads == "adaptive"

  def scores(self, q: jax.Array, k: jax.Array, lengths: jax.Array) -> jax.Array:
    """q [B, T, N, H], k [B, K, T, H] of a prompt (columns = positions 0..T-1), lengths int[B]
    -> float32 [B, K, T]; columns past lengths[b] may hold anything (the cache never keeps them).
    A press that reads the values, the layer's RoPE or its output projection overrides prompt_scores
    instead."""
    raise NotImplementedError(f"{type(self).__name__} scores through prompt_scores (values, RoPE)")

  def arrival_scores(self, k: jax.Array, positions: jax.Array) -> jax.Array:
    """Scores of tokens written after the prompt: k [B, K, T, H] at positions int[B, T] -> [B, K, T]."""
    return jnp.broadcast_to(RECENT + positions[:, None, :].astype(jnp.float32), k.shape[:3])

  @property
  def reads_channels(self) -> bool:
    """Whether the scores read query or key channels one by one (through RoPE's frequencies): such
    a press cannot score a rotated cache (CacheConfig.rotation, kvjax.cache.rotation)."""
    return False

  def prompt_scores(
    self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope: Rope | None, out: jax.Array | None = None
  ) -> jax.Array:
    """What the evicting cache calls: `scores`, with the values v [B, K, T, H], the layer's RoPE
    (None: learned positions) and its output projection out float32 [N, H, D] (KVQuery.out; None
    where the caller has none) beside, for a press that reads them."""
    return self.scores(q, k, lengths)


def last_columns(lengths: jax.Array, window: int) -> jax.Array:
  """int[B, window]: each row's last `window` columns, oldest first (negative where the row is shorter)."""
  return lengths[:, None] - window + jnp.arange(window)[None, :]


def kept_above(scores: jax.Array, keep: jax.Array) -> jax.Array:
  """scores [B, K, T] with the columns where keep bool[B, T] (or per head, [B, K, T]) is set
  raised above every other score of their row (to the row's maximum over all heads + 1, one
  value, as kvpress does): head-adaptive budgets compare scores across heads."""
  keep = keep if keep.ndim == 3 else keep[:, None]
  best = jnp.max(jnp.where(keep, -jnp.inf, scores), axis=(1, 2), keepdims=True)
  best = jnp.where(jnp.isfinite(best), best, 0.0)
  return jnp.where(keep, best + 1, scores)


def check_wrapper(press: Press, does: str) -> None:
  """Checks a press over another's scores (ChunkKV, CriticalKV): its `scorer` field, chosen
  (Press.choose) and set back, must be a layer press that scores tokens one by one with its budgets
  at their defaults, and the wrapper's own budget one uniform budget of the prompt (`does`: what the
  wrapper does that needs it); ValueError naming the field otherwise."""
  name = type(press).__name__
  object.__setattr__(press, "scorer", Press.choose(press.scorer, f"{name}.scorer"))
  inner = press.scorer
  if (
    Press.scoring.fget(inner) != inner
    or inner.model_level
    or inner.grouped
    or isinstance(getattr(inner, "scorer", None), Press)
  ):
    raise ValueError(
      f"{name}.scorer={inner!r} must be a layer press that scores tokens one by one, with its budgets at their "
      f"defaults ({name} decides what is kept: set compression_ratio on the {name})"
    )
  if press.heads != "uniform" or press.layers != "uniform" or press.decode_budget:
    raise ValueError(
      f"{name} {does}: leave heads, layers and decode_budget at their defaults, got heads={press.heads!r}, "
      f"layers={press.layers!r}, decode_budget={press.decode_budget}"
    )


PRESSES = Press.kinds  # {name: press class}, filled as each press module defines its class


def make_press(name: str, **fields) -> Press:
  """The press called `name` with `fields` (a study holding press names builds its caches so);
  ValueError naming the press or field that is not one."""
  return Press.choose({"name": name, **fields}, "press")
