"""KVzip's repeat prompt in a model's own tokens (kvjax.cache.kvzip): kvpress's texts, and the
chat template's opening (not reconstructed) and reply header (read before the reconstruction),
found as kvpress finds them, by rendering a dummy user turn."""

from __future__ import annotations

import dataclasses

from kvjax.cache.config import CacheConfig
from kvjax.cache.kvzip import KVzip
from kvjax.interop.tokenizer import TextTokenizer

REPEAT = "\n\nRepeat the previous context exactly."  # kvpress's KVzipPress.prepare, the first chunk
RESUME = "\n\nRepeat the part of the previous context exactly, starting with"  # a later chunk
DUMMY = "dummy context"


def repeat_prompt(tokenizer: TextTokenizer) -> dict:
  """{repeat_ids, resume_ids, suffix_ids, prefix}: KVzip's fields for a model of `tokenizer`."""
  if tokenizer.chat_template is None:
    prefix, suffix = "", "\n"
  else:
    separator = "\n" + "#" * len(DUMMY)
    text = tokenizer.apply_chat_template([{"role": "user", "content": DUMMY + separator}], add_generation_prompt=True)
    context, suffix = text.split(separator)
    prefix = context.split(DUMMY)[0]
  encode = lambda text: tuple(int(i) for i in tokenizer.encode(text))
  return {
    "repeat_ids": encode(REPEAT),
    "resume_ids": encode(RESUME),
    "suffix_ids": encode(suffix),
    "prefix": len(encode(prefix)),
  }


def with_repeat_prompt(cache_config: CacheConfig, tokenizer: TextTokenizer | None) -> CacheConfig:
  """`cache_config` with a KVzip press's repeat prompt taken from `tokenizer` where it has none;
  any other cache unchanged. ValueError for a KVzip press without a tokenizer."""
  press = cache_config.press
  if not isinstance(press, KVzip) or press.repeat_ids:
    return cache_config
  if tokenizer is None:
    raise ValueError(
      f"CacheConfig.press={press!r}: KVzip's repeat prompt is read in the model's tokens, and this model has no tokenizer"
    )
  return cache_config.replace(press=dataclasses.replace(press, **repeat_prompt(tokenizer)))
