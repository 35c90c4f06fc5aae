"""KVzip's repeat prompt in SmolLM2's tokens (KVzip.bind, CacheConfig.bind): the ids kvpress's
KVzipPress reads from the same GGUF file's tokenizer through transformers (recorded from kvpress
0.5.5 / transformers 5.2), and the press filled from a tokenizer, or refused without one."""

from __future__ import annotations

import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cache.kvzip import KVzip
from kvjax.cache.presses import SnapKV
from kvjax.interop.tokenizer import TextTokenizer

KVPRESS_SMOLLM2 = {
  "repeat_ids": (198, 198, 48010, 260, 2672, 2468, 3869, 30),
  "resume_ids": (198, 198, 48010, 260, 599, 282, 260, 2672, 2468, 3869, 28, 4335, 351),
  "suffix_ids": (2, 198, 1, 520, 9531, 198),  # <|im_end|>\n<|im_start|>assistant\n
  "prefix": 24,  # the system turn and <|im_start|>user\n
}


def test_the_repeat_prompt_is_kvpress_s_in_smollm2_tokens(smollm2):
  tokenizer = TextTokenizer.load(smollm2)
  filled = CacheConfig(press=KVzip(compression_ratio=0.5)).bind(tokenizer)
  assert filled.press == KVzip(compression_ratio=0.5, **KVPRESS_SMOLLM2)
  assert filled.bind(None) == filled  # already bound: kept
  snapkv = CacheConfig(press=SnapKV(compression_ratio=0.5))
  assert snapkv.bind(None) == snapkv and CacheConfig().bind(None) == CacheConfig()
  with pytest.raises(ValueError, match="has no tokenizer"):
    CacheConfig(press=KVzip(compression_ratio=0.5)).bind(None)
