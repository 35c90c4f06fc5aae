"""Presses: how an evicting cache (kvjax.cache.layouts.evict) scores the tokens it may keep.

A press is a value, CacheConfig.press (e.g. SnapKV(compression_ratio=0.75, window=64)): a frozen
dataclass holding its settings, each checked in __post_init__. It scores every token of a prompt
per row and kv head, from the prompt's own queries and keys as the layer computes them, higher
meaning worth keeping; the cache keeps the int(n * (1 - compression_ratio)) best of a row's n
prompt tokens (NVIDIA kvpress's ScorerPress rule). Tokens that arrive later (extend, decode) get an
arrival score, and once a row's slots are full each arrival replaces the lowest-scoring token held.

Every press has, beside its own settings (the base class `Press`):
  compression_ratio  the fraction of a prompt's tokens dropped, in [0, 1);
  heads              "uniform" (every kv head keeps as many tokens) or "adaptive" (AdaKV, Feng et
                     al. 2024: a row's budget goes to its heads' best tokens together, each head
                     first keeping `safeguard` of its share; kvjax.cache.selection.head_budgets);
  safeguard          that share, in [0, 1] (read with heads="adaptive" only);
  layers             "uniform" (every layer keeps int(n * (1 - compression_ratio)) of a prompt's n
                     tokens) or "pyramid" (PyramidKV, Cai et al. 2024: budgets that shrink
                     linearly with depth, the same total over the layers; kvjax.cache.selection, after
                     kvpress's PyramidKVPress, whose window is the press's min_slots: SnapKV's
                     window, 0 for a press that always keeps nothing);
  beta               the pyramid's steepness, an int >= 1 (the shallowest layer keeps about
                     2 - 1 / beta times the uniform budget, the deepest 1 / beta of it).
  decode_budget      tokens a row holds after each pressing during decoding (0: no pressing; the
                     slots follow max_len and compression_ratio). With a budget the cache has
                     decode_budget + max(decode_interval, prefill_chunk) slots whatever the length,
                     and presses a row back to the budget when its slots fill (every
                     decode_interval generated tokens) and after every call of several tokens;
  decode_interval    generated tokens between pressings (kvpress's DecodingPress compression_interval);
  prefill_chunk      a prompt longer than this is prefilled in chunks of it, each pressed into the
                     budget as it arrives (0: one call; needs decode_budget).
At a pressing a row drops its lowest-scoring held tokens (ties: the earlier position); the scores
are the arrival scores, except for the decode-time rules of TOVA (the attention of the call's last
query, averaged over every query head) and H2O (`observed`: each held token's score accumulates
the attention it receives at every call, averaged over its group; an arrival starts from the
attention of its own call), which need the call's attention weights (kvjax.cache.layouts.evict reads them
through XLA).
A press is one module of this package holding its class (its `name` enters it in PRESSES,
kvjax.fields.Named, when the class is defined), and one import line below: adding a press touches
nothing else. The command line chooses one by name and sets its fields:
`--set cache.press=snapkv cache.press.window=32 cache.press.compression_ratio=0.5`; a budget
composes with any scorer: `--set cache.press=snapkv cache.press.layers=pyramid` is kvpress's
PyramidKVPress, `cache.press.heads=adaptive` AdaKV's.

The presses, one module each (its docstring gives the published definition it follows, and
kvpress's reading of it): streaming_llm, snapkv, tova, observed, knorm, random, keydiff,
expected_attention, cur, lagkv, leverage, compactor (leverage blended with chunked attention),
chunkkv (whole chunks by any scorer's scores) and criticalkv (any scorer's scores weighed by what
each value adds to the layer's output). The attention presses (snapkv, tova, observed) score
arrivals above any attention weight, in order of position: after the prefill's least attended
tokens, the oldest arrivals go first.

Ties keep the earlier position. Every score is float32 [B, K, T].
"""

from kvjax.cache.presses.base import PRESSES, RECENT, Press, attention_weights, causal_weights, make_press

# One line per press: importing its module defines its class, which enters it in PRESSES.
from kvjax.cache.presses.streaming_llm import StreamingLLM
from kvjax.cache.presses.snapkv import SnapKV
from kvjax.cache.presses.tova import TOVA
from kvjax.cache.presses.observed import ObservedAttention
from kvjax.cache.presses.knorm import KNorm
from kvjax.cache.presses.random import Random
from kvjax.cache.presses.keydiff import KeyDiff
from kvjax.cache.presses.expected_attention import ExpectedAttention
from kvjax.cache.presses.cur import CUR
from kvjax.cache.presses.lagkv import LagKV
from kvjax.cache.presses.chunkkv import ChunkKV
from kvjax.cache.presses.leverage import LeverageScore
from kvjax.cache.presses.compactor import Compactor
from kvjax.cache.presses.criticalkv import CriticalKV

__all__ = [
  "PRESSES",
  "RECENT",
  "Press",
  "attention_weights",
  "causal_weights",
  "make_press",
  "StreamingLLM",
  "SnapKV",
  "TOVA",
  "ObservedAttention",
  "KNorm",
  "Random",
  "KeyDiff",
  "ExpectedAttention",
  "CUR",
  "LagKV",
  "ChunkKV",
  "LeverageScore",
  "Compactor",
  "CriticalKV",
]
