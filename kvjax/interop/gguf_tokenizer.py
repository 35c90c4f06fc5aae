"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's metadata (tokenizer.ggml.*), the way
transformers' GGUF loader builds it, so the ids equal those of
`AutoTokenizer.from_pretrained(folder, gguf_file=name)`.

'gpt2' files are byte-level BPE: the vocabulary respelled in GPT-2's byte alphabet, the file's
merges, text split by the regex tokenizer.ggml.pre names (llama.cpp's names, transformers' table:
PRE_TOKENIZER_SPLITS; GPT-2's own split for a name not in it: 'default', 'gpt2', 'smollm', ...).
'llama' files are SentencePiece BPE as LlamaTokenizer builds it: '▁' for spaces, one prepended to
the text, byte fallback, merges from the file or recovered from the token scores. Gemma's 'llama'
files (GGUF_LLAMA_CPP_SENTENCEPIECE) are built by llama.cpp's SPM rules instead, since
transformers' Gemma GGUF tokenizer is not what the model was trained with (it splits "capital"
into c|ap|it|al): every space becomes '▁' with none prepended (add_space_prefix false), the
adjacent pair whose concatenation is the best-scored token merges first, a character outside the
vocabulary falls back to its <0xNN> bytes; the ids equal llama.cpp's
(tests/interop/data/gemma3_token_ids.json). Either way CONTROL tokens (token_type 3) are matched
whole as special tokens, USER_DEFINED ones (4: Gemma's runs of spaces, tabs and newlines, HTML
tags) whole as plain added tokens, before any merge.

`build` is the entry; kvjax.interop.tokenizer.TextTokenizer.from_gguf_metadata wraps what it returns.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

GGUF_MODELS = ("gpt2", "llama")
# Architectures whose 'llama' vocabulary is built by llama.cpp's SPM rules (the module docstring).
GGUF_LLAMA_CPP_SENTENCEPIECE = ("gemma", "gemma2", "gemma3")
# Architectures whose 'llama' vocabulary is built another way (Phi-3: llama.cpp strips spaces after
# its special tokens): refused, not approximated.
GGUF_OTHER_SENTENCEPIECE = ("phi3",)
SPACE = "\u2581"  # SentencePiece's visible space
GGUF_SPECIAL_KEYS = {
  "bos": "tokenizer.ggml.bos_token_id",
  "eos": "tokenizer.ggml.eos_token_id",
  "pad": "tokenizer.ggml.padding_token_id",
  "unk": "tokenizer.ggml.unknown_token_id",
}
# The llama.cpp-rule vocabularies' end of turn: the file's tokenizer.ggml.eot_token_id, else the
# token llama.cpp finds by name (Gemma's chat turns end with it; a model that writes it is done).
GGUF_EOT_KEY, END_OF_TURN = "tokenizer.ggml.eot_token_id", "<end_of_turn>"
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp's token_type codes

_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex its merges were learned after (transformers' table).
PRE_TOKENIZER_SPLITS = {
  **dict.fromkeys(
    (
      "llama3",
      "llama-v3",
      "llama-bpe",
      "falcon3",
      "falcon-h1",
      "pixtral",
      "midm-2.0",
      "lfm2",
      "jina-v5-nano",
      "dbrx",
      "smaug-bpe",
    ),
    _LLAMA3_SPLIT,
  ),
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
  "qwen35": _QWEN35_SPLIT,
  "tekken": _TEKKEN_SPLIT,
  **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def build(metadata: Mapping[str, Any], source: str = "GGUF") -> tuple[Tokenizer, dict[str, int | None], bool]:
  """The tokenizer a GGUF file's metadata describes ({key: python value}) -> (tokenizer, its
  special ids {'bos': ..., 'eos', 'pad', 'unk', 'eot'} (None where the file names none; 'eot' only
  for the llama.cpp-rule vocabularies), whether a BOS is prepended). ValueError naming the key for
  a missing vocabulary, merges or scores, an unsupported tokenizer.ggml.model or add_space_prefix,
  or a special id outside the vocabulary."""
  tokens = metadata.get("tokenizer.ggml.tokens")
  if tokens is None or len(tokens) == 0:
    raise ValueError(f"{source} has no tokenizer.ggml.tokens: it carries no tokenizer")
  tokens = [str(token) for token in tokens]
  kind = metadata.get("tokenizer.ggml.model")
  if kind not in GGUF_MODELS:
    raise ValueError(f"{source} has tokenizer.ggml.model={kind!r}; kvjax builds {', '.join(GGUF_MODELS)}")
  architecture = metadata.get("general.architecture")
  if kind == "llama" and architecture in GGUF_OTHER_SENTENCEPIECE:
    raise ValueError(
      f"{source}: the SentencePiece vocabulary of general.architecture={architecture!r} is built "
      "another way than Llama's, which kvjax does not do"
    )
  types = list(metadata.get("tokenizer.ggml.token_type") or [])
  if types and len(types) != len(tokens):
    raise ValueError(f"{source} has {len(types)} tokenizer.ggml.token_type entries for {len(tokens)} tokens")
  special = {name: _gguf_special_id(metadata, key, len(tokens), source) for name, key in GGUF_SPECIAL_KEYS.items()}
  llama_cpp_rules = kind == "llama" and architecture in GGUF_LLAMA_CPP_SENTENCEPIECE
  special["eot"] = _gguf_special_id(metadata, GGUF_EOT_KEY, len(tokens), source) if llama_cpp_rules else None
  if llama_cpp_rules and special["eot"] is None:
    special["eot"] = next((i for i, token in enumerate(tokens) if token == END_OF_TURN), None)
  if kind == "gpt2":
    tokenizer, spelled = _byte_level_bpe(tokens, metadata, source)
  elif llama_cpp_rules:
    tokenizer, spelled = _llama_cpp_sentencepiece(tokens, metadata, source), tokens
  else:
    tokenizer, spelled = _sentencepiece_bpe(tokens, metadata, source), tokens
  # Added only where the token is spelled as the vocabulary spells it: transformers appends a
  # mislabelled byte-level token (one outside the byte alphabet) as a new id past the vocabulary.
  control = [t for t, s, token_type in zip(tokens, spelled, types) if token_type == GGUF_CONTROL and t == s]
  named = [tokens[i] for i in special.values() if i is not None and tokens[i] == spelled[i]]
  tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control + named)])
  user = [t for t, s, token_type in zip(tokens, spelled, types) if token_type == GGUF_USER_DEFINED and t == s]
  tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  # llama.cpp adds a BOS to a SentencePiece vocabulary that does not say otherwise.
  add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
  return tokenizer, special, bool(add_bos)


@functools.cache
def _byte_spelling() -> dict[int, str]:
  """GPT-2's byte -> character table: printable bytes stand for themselves, the others move to
  chr(256 + n), so every byte-level token is printable text."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  spelling = {byte: chr(byte) for byte in printable}
  spelling.update({byte: chr(256 + n) for n, byte in enumerate(b for b in range(256) if b not in spelling)})
  return spelling


def _byte_level_bpe(tokens: list[str], metadata: Mapping[str, Any], source: str) -> tuple[Tokenizer, list[str]]:
  """Byte-level BPE of a 'gpt2' vocabulary and the vocabulary's spelling of each token (a token
  that is not already byte-alphabet text is respelled from its UTF-8 bytes)."""
  if "tokenizer.ggml.merges" not in metadata:
    raise ValueError(
      f"{source} is a byte-level BPE vocabulary without tokenizer.ggml.merges; its tokenizer cannot be rebuilt"
    )
  spelling = _byte_spelling()
  alphabet = set(spelling.values())
  spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
  vocab = {token: i for i, token in enumerate(spelled)}
  tokenizer = _bpe(
    vocab, _gguf_merges(metadata, source), source, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
  )
  split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
  if split is None:  # GPT-2's split, ByteLevel's built-in regex
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )  # the split is done above
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer, spelled


def _sentencepiece_bpe(tokens: list[str], metadata: Mapping[str, Any], source: str) -> Tokenizer:
  """SentencePiece BPE of a 'llama' vocabulary, as transformers' LlamaTokenizer builds it."""
  vocab = {token: i for i, token in enumerate(tokens)}
  if "tokenizer.ggml.merges" in metadata:
    merges = _gguf_merges(metadata, source)
  elif metadata.get("tokenizer.ggml.scores") is not None:
    merges = _merges_from_scores(vocab, dict(zip(tokens, (float(s) for s in metadata["tokenizer.ggml.scores"]))))
  else:
    raise ValueError(f"{source} has neither tokenizer.ggml.merges nor tokenizer.ggml.scores to rank merges by")
  tokenizer = _bpe(vocab, merges, source, fuse_unk=True, byte_fallback=True)
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
  tokenizer.decoder = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
  )
  return tokenizer


def _llama_cpp_sentencepiece(tokens: list[str], metadata: Mapping[str, Any], source: str) -> Tokenizer:
  """SentencePiece BPE of a 'llama' vocabulary by llama.cpp's rules (llm_tokenizer_spm): merges
  from the scores of every token, spaces to '▁' with none prepended, byte fallback."""
  if metadata.get("tokenizer.ggml.add_space_prefix", True):  # llama.cpp's default for SPM is true
    raise ValueError(
      f"{source} has tokenizer.ggml.add_space_prefix true (or unset): llama.cpp then prefixes a space to the "
      "text after every special token, which kvjax does not rebuild"
    )
  scores = metadata.get("tokenizer.ggml.scores")
  if scores is None or len(scores) != len(tokens):
    raise ValueError(
      f"{source} has {0 if scores is None else len(scores)} tokenizer.ggml.scores for {len(tokens)} tokens; "
      "llama.cpp's SentencePiece merges need one score per token"
    )
  vocab = {token: i for i, token in enumerate(tokens)}
  tokenizer = _bpe(
    vocab, _merges_from_scores(vocab, dict(zip(tokens, (float(s) for s in scores)))), source, byte_fallback=True
  )
  tokenizer.normalizer = normalizers.Replace(" ", SPACE)  # after the added tokens: runs of spaces stay whole
  tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
  return tokenizer


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], source: str, **options) -> Tokenizer:
  try:
    return Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, **options))
  except Exception as err:  # tokenizers raises plain Exceptions, e.g. for a merge of unknown tokens
    raise ValueError(f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {err}") from None


def _gguf_merges(metadata: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
  merges = [str(merge).split(" ") for merge in metadata["tokenizer.ggml.merges"]]
  bad = next((i for i, pair in enumerate(merges) if len(pair) != 2), None)
  if bad is not None:
    raise ValueError(
      f"{source}: tokenizer.ggml.merges[{bad}]={' '.join(merges[bad])!r} is not two tokens separated by one space"
    )
  return [(left, right) for left, right in merges]


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
  """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, best
  score first, ties to the shorter left part (transformers' order, so the ids agree)."""
  merges = []
  for token, score in scores.items():
    pairs = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
    merges.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
  merges.sort(key=lambda pair: (pair[2], len(pair[0]), len(pair[1])), reverse=True)
  return [(left, right) for left, right, _ in merges]


def _gguf_special_id(metadata: Mapping[str, Any], key: str, num_tokens: int, source: str) -> int | None:
  token_id = metadata.get(key)
  if token_id is None:
    return None
  if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or not 0 <= token_id < num_tokens:
    raise ValueError(f"{source}: {key}={token_id!r} is not an id of its {num_tokens}-token vocabulary")
  return int(token_id)
