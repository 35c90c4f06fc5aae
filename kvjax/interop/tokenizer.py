"""A model's text tokenizer: text to ids and back, its special ids, its chat template.

Built on the `tokenizers` library from either place a model keeps its tokenizer:
- a tokenizer.json (a Hugging Face model directory, a kvjax workdir) with the tokenizer_config.json
  beside it for the special tokens, add_bos_token and the chat template (transformers 4.43+ write
  the template to chat_template.jinja instead; that file is read when the config has none);
- a GGUF file's metadata (tokenizer.ggml.*), rebuilt as transformers' GGUF loader builds it
  (kvjax.interop.gguf_tokenizer), so the ids equal those of
  `AutoTokenizer.from_pretrained(folder, gguf_file=name)`; Gemma's by llama.cpp's rules instead,
  so its ids equal llama.cpp's.

encode never runs the tokenizer's post-processor: whether a BOS is prepended is `add_bos`, decided
once (tokenizer_config.json's add_bos_token, else what tokenizer.json's post-processor does, or the
GGUF flag), so no path adds a BOS twice.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import numpy as np
from tokenizers import Tokenizer

from kvjax.interop import gguf_tokenizer
from kvjax.interop.hf_files import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, load_tokenizer

# Markers chat templates end a turn with; one that is a token and appears in the template stops
# generation (a base model without a template stops at eos only).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "</s>", "<|eom_id|>")


class TextTokenizer:
  """A `tokenizers.Tokenizer` with the model's special ids and chat template.

  Attributes:
    tokenizer: the backend; its post-processor is not used by encode (see the module docstring).
    bos_id, eos_id, pad_id, unk_id: the special ids, None where the model has none.
    eot_id: the token that ends a turn, a stop id with or without a chat template (Gemma's
      <end_of_turn>; kept in tokenizer_config.json as eot_token); None for most models, whose
      turn markers stop only when their template writes them.
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
    eot_id: int | None = None,
    add_bos: bool = False,
    chat_template: str | None = None,
    source: str = "tokenizer",
  ):
    self.tokenizer, self.source = tokenizer, source
    self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    special = {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id, "unk_id": unk_id, "eot_id": eot_id}
    for name, token_id in special.items():
      if token_id is not None and not 0 <= token_id < self._vocab_size:
        raise ValueError(f"{source}: {name}={token_id} is not an id of its {self._vocab_size}-token vocabulary")
    self.bos_id, self.eos_id, self.pad_id, self.unk_id, self.eot_id = bos_id, eos_id, pad_id, unk_id, eot_id
    self.add_bos = bool(add_bos) and bos_id is not None  # no BOS to add means none is added (as transformers)
    self.chat_template = chat_template
    self._compiled: tuple[str, Any] | None = None  # (template text, jinja2 Template)

  @property
  def vocab_size(self) -> int:
    """The ids it can produce, added tokens included (max id + 1)."""
    return self._vocab_size

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """eos_id, eot_id, and the END_OF_TURN_TOKENS that are tokens and that the chat template writes."""
    ids = {token_id for token_id in (self.eos_id, self.eot_id) if token_id is not None}
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
    if self.eot_id is not None:
      config["eot_token"] = self.tokenizer.id_to_token(self.eot_id)
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
      name: _config_token_id(tokenizer, config, f"{name}_token", config_path)
      for name in ("bos", "eos", "pad", "unk", "eot")
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
      eot_id=ids["eot"],
      add_bos=bool(add_bos),
      chat_template=template,
      source=str(root / TOKENIZER_FILE),
    )

  @classmethod
  def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "GGUF") -> TextTokenizer:
    """The tokenizer a GGUF file's metadata describes ({key: python value}, built by
    kvjax.interop.gguf_tokenizer); ids identical to transformers' for the same file (to llama.cpp's
    for Gemma's, kvjax.interop.gguf_tokenizer.GGUF_LLAMA_CPP_SENTENCEPIECE). ValueError
    naming the key for a missing vocabulary or merges, an unsupported tokenizer.ggml.model, or a
    special id outside the vocabulary."""
    tokenizer, special, add_bos = gguf_tokenizer.build(metadata, source)
    return cls(
      tokenizer,
      **{f"{name}_id": token_id for name, token_id in special.items()},
      add_bos=add_bos,
      chat_template=metadata.get("tokenizer.chat_template"),
      source=source,
    )


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
