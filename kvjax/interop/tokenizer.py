"""A model's text tokenizer: text to ids and back, its special ids, its chat template.

Built on the `tokenizers` library from either place a model keeps its tokenizer:
- a tokenizer.json (a Hugging Face model directory, a kvjax workdir) with the tokenizer_config.json
  beside it for the special tokens, add_bos_token and the chat template (transformers 4.43+ write
  the template to chat_template.jinja instead; that file is read when the config has none);
- a GGUF file's metadata (tokenizer.ggml.*), rebuilt the way transformers' GGUF loader builds it,
  so the ids equal those of `AutoTokenizer.from_pretrained(folder, gguf_file=name)`. 'gpt2' files
  are byte-level BPE: the vocabulary respelled in GPT-2's byte alphabet, the file's merges, text
  split by the regex tokenizer.ggml.pre names (GPT-2's own for a name not in
  PRE_TOKENIZER_SPLITS: 'default', 'gpt2', 'smollm', ...). 'llama' files are SentencePiece BPE
  as LlamaTokenizer builds it: '▁' for spaces, one prepended to the text, byte fallback, merges
  from the file or recovered from the token scores. Either way CONTROL tokens (token_type 3) are
  matched whole as special tokens, USER_DEFINED ones (4) whole as plain added tokens.

encode never runs the tokenizer's post-processor: whether a BOS is prepended is `add_bos`, decided
once (tokenizer_config.json's add_bos_token, else what tokenizer.json's post-processor does, or the
GGUF flag), so no path adds a BOS twice.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any, Mapping

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvjax.interop.hf_files import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, load_tokenizer

# Markers chat templates end a turn with; one that is a token and appears in the template stops
# generation (a base model without a template stops at eos only).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "</s>", "<|eom_id|>")
GGUF_MODELS = ("gpt2", "llama")
# Architectures whose 'llama' vocabulary transformers builds differently (Gemma respells space
# tokens and reorders merges, Phi-3 prepends the space in a normalizer): refused, not approximated.
GGUF_OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")
GGUF_SPECIAL_KEYS = {
  "bos": "tokenizer.ggml.bos_token_id",
  "eos": "tokenizer.ggml.eos_token_id",
  "pad": "tokenizer.ggml.padding_token_id",
  "unk": "tokenizer.ggml.unknown_token_id",
}
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


class TextTokenizer:
  """A `tokenizers.Tokenizer` with the model's special ids and chat template.

  Attributes:
    tokenizer: the backend; its post-processor is not used by encode (see the module docstring).
    bos_id, eos_id, pad_id, unk_id: the special ids, None where the model has none.
    add_bos: encode(add_special_tokens=True) prepends bos_id.
    chat_template: the Jinja chat template, None for a model without one.
    source: where it came from (a file, 'GGUF'), named by its errors.
  """

  def __init__(
    self,
    tokenizer: Tokenizer,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    unk_id: int | None = None,
    add_bos: bool = False,
    chat_template: str | None = None,
    source: str = "tokenizer",
  ):
    self.tokenizer, self.source = tokenizer, source
    self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    for name, token_id in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id), ("unk_id", unk_id)):
      if token_id is not None and not 0 <= token_id < self._vocab_size:
        raise ValueError(f"{source}: {name}={token_id} is not an id of its {self._vocab_size}-token vocabulary")
    self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
    self.add_bos = bool(add_bos) and bos_id is not None  # no BOS to add means none is added (as transformers)
    self.chat_template = chat_template
    self._compiled: tuple[str, Any] | None = None  # (template text, jinja2 Template)

  @property
  def vocab_size(self) -> int:
    """The ids it can produce, added tokens included (max id + 1)."""
    return self._vocab_size

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """eos_id plus the END_OF_TURN_TOKENS that are tokens and that the chat template writes."""
    ids = {self.eos_id} if self.eos_id is not None else set()
    for marker in END_OF_TURN_TOKENS if self.chat_template else ():
      token_id = self.tokenizer.token_to_id(marker)
      if token_id is not None and marker in self.chat_template:
        ids.add(token_id)
    return tuple(sorted(ids))

  def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
    """int32 [n] ids of `text`; special tokens written in it are matched whole. With
    add_special_tokens, bos_id first when add_bos."""
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if add_special_tokens and self.add_bos:
      ids = [self.bos_id, *ids]
    return np.asarray(ids, dtype=np.int32)

  def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
    """The text of ids [n] (a list or an integer array)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
      raise ValueError(f"decode takes a 1-D sequence of integer ids, got shape {ids.shape} of {ids.dtype}")
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation ([{'role': ..., 'content': ...}, ...]), rendered as
    transformers renders it: sandboxed Jinja, the special tokens as variables, keys whose value
    is None dropped from the messages."""
    import jinja2  # only chat needs it

    if self.chat_template is None:
      raise ValueError(f"{self.source} has no chat template: format the prompt as plain text")
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping):
        raise ValueError(f"chat message {i} is a {type(message).__name__}, not a dict with 'role' and 'content'")
    messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
    special = {
      f"{name}_token": self.tokenizer.id_to_token(token_id)
      for name, token_id in (("bos", self.bos_id), ("eos", self.eos_id), ("unk", self.unk_id), ("pad", self.pad_id))
      if token_id is not None
    }
    try:
      return self._template().render(
        messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **special
      )
    except (jinja2.TemplateError, TypeError) as err:
      raise ValueError(f"the chat template of {self.source} failed on these messages: {err}") from None

  def _template(self):
    """The compiled chat template, compiled again only when the text changes."""
    if self._compiled is None or self._compiled[0] != self.chat_template:
      self._compiled = (self.chat_template, _compile_template(self.chat_template, self.source))
    return self._compiled[1]

  def save(self, directory: str | pathlib.Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json (the keys transformers reads) into
    `directory`. A chat_template.jinja already there is rewritten or removed, since transformers
    prefers it to the config's template."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self.tokenizer.save(str(directory / TOKENIZER_FILE))
    tokens = {
      f"{name}_token": None if token_id is None else self.tokenizer.id_to_token(token_id)
      for name, token_id in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id), ("unk", self.unk_id))
    }
    # tokenizer_class lets transformers load the directory without a config.json.
    config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "add_bos_token": self.add_bos,
      **tokens,
      "chat_template": self.chat_template,
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(
      json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    stale = directory / CHAT_TEMPLATE_FILE
    if self.chat_template is not None and stale.exists():
      stale.write_text(self.chat_template, encoding="utf-8")
    elif stale.exists():
      stale.unlink()

  @classmethod
  def load(cls, directory: str | pathlib.Path, vocab_size: int | None = None) -> TextTokenizer | None:
    """The tokenizer of a directory's tokenizer.json (or of that file itself), or None when it has
    none. Special tokens (strings or {'content': ...}), add_bos_token and chat_template come from
    tokenizer_config.json beside it when present. ValueError naming the file when one is not
    valid, names a token the tokenizer lacks, or (given vocab_size) holds ids >= vocab_size."""
    tokenizer = load_tokenizer(directory, vocab_size)
    if tokenizer is None:
      return None
    path = pathlib.Path(directory)
    root = path if path.is_dir() else path.parent
    config_path = root / TOKENIZER_CONFIG_FILE
    config = _read_json_object(config_path) if config_path.is_file() else {}
    ids = {
      name: _config_token_id(tokenizer, config, f"{name}_token", config_path) for name in ("bos", "eos", "pad", "unk")
    }
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # e.g. Llama 3's directories: the BOS is added by tokenizer.json's post-processor
      with_special = tokenizer.encode("a", add_special_tokens=True).ids
      plain = tokenizer.encode("a", add_special_tokens=False).ids
      add_bos = len(with_special) > len(plain) and with_special[0] == ids["bos"]
    template = _config_template(config, config_path, root / CHAT_TEMPLATE_FILE)
    return cls(
      tokenizer,
      bos_id=ids["bos"],
      eos_id=ids["eos"],
      pad_id=ids["pad"],
      unk_id=ids["unk"],
      add_bos=bool(add_bos),
      chat_template=template,
      source=str(root / TOKENIZER_FILE),
    )

  @classmethod
  def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "GGUF") -> TextTokenizer:
    """The tokenizer a GGUF file's metadata describes ({key: python value}); ids identical to
    transformers' for the same file. ValueError naming the key for a missing vocabulary or
    merges, an unsupported tokenizer.ggml.model, or a special id outside the vocabulary."""
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
    if kind == "gpt2":
      tokenizer, spelled = _byte_level_bpe(tokens, metadata, source)
    else:
      tokenizer, spelled = _sentencepiece_bpe(tokens, metadata, source), tokens
    # Added only where the token is spelled as the vocabulary spells it: transformers appends a
    # mislabelled byte-level token (one outside the byte alphabet) as a new id past the vocabulary.
    control = [t for t, s, token_type in zip(tokens, spelled, types) if token_type == GGUF_CONTROL and t == s]
    named = [tokens[i] for i in special.values() if i is not None and tokens[i] == spelled[i]]
    tokenizer.add_special_tokens(
      [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control + named)]
    )
    user = [t for t, s, token_type in zip(tokens, spelled, types) if token_type == GGUF_USER_DEFINED and t == s]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    # llama.cpp adds a BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return cls(
      tokenizer,
      **{f"{name}_id": token_id for name, token_id in special.items()},
      add_bos=bool(add_bos),
      chat_template=metadata.get("tokenizer.chat_template"),
      source=source,
    )


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


def _read_json_object(path: pathlib.Path) -> dict:
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise ValueError(f"{path} is not valid JSON: {err}") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a JSON {type(value).__name__}, not a tokenizer config object")
  return value


def _config_token_id(tokenizer: Tokenizer, config: dict, key: str, path: pathlib.Path) -> int | None:
  """The id of the token config[key] names (a string, or transformers' {'content': ...})."""
  token = config.get(key)
  if isinstance(token, dict):
    token = token.get("content")
  if token is None:
    return None
  token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
  if token_id is None:
    raise ValueError(f"{path}: {key}={token!r} is not a token of the {TOKENIZER_FILE} beside it")
  return token_id


def _config_template(config: dict, path: pathlib.Path, jinja_file: pathlib.Path) -> str | None:
  """The chat template: the config's (a string, or a list of named templates: 'default'), else
  the chat_template.jinja file's, else None."""
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  if template is not None and not isinstance(template, str):
    raise ValueError(f"{path}: chat_template is a {type(template).__name__}, not a Jinja template string")
  if template is None and jinja_file.is_file():
    template = jinja_file.read_text(encoding="utf-8")
  return template


def _compile_template(template: str, source: str):
  """A chat template compiled in transformers' sandbox: trimmed blocks, a `tojson` that keeps
  non-ASCII text, raise_exception, strftime_now, loop controls and a pass-through
  {% generation %} block."""
  import datetime

  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks assistant text with it; it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as err:
    raise ValueError(f"the chat template of {source} is not valid Jinja (line {err.lineno}): {err.message}") from None
