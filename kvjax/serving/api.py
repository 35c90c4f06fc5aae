"""The OpenAI API's completions and chat completions, as `kvjax serve` speaks them: a request body
checked and turned into token ids and settings, the text of a growing answer cut at its stop
sequences, and the response and stream-chunk bodies.

Every field a request may carry is listed here. A field kvjax does not implement is refused by
name unless it holds its default (n=1, presence_penalty=0, ...), so a client never gets an
answer computed without a setting it asked for; an unknown field is refused with the list of
known ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from kvjax.decoding.sampling import Sampling
from kvjax.interop.tokenizer import TextTokenizer

COMPLETIONS, CHAT = "text_completion", "chat.completion"
MAX_STOPS = 4
ROLES = ("system", "developer", "user", "assistant")


class RequestError(ValueError):
  """A request the server refuses: `status` (400, 404, 413) and the field at fault (`param`)."""

  def __init__(self, message: str, param: str | None = None, status: int = 400):
    super().__init__(message)
    self.param, self.status = param, status

  def body(self) -> dict:
    kind = "invalid_request_error" if self.status != 404 else "not_found_error"
    return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclasses.dataclass(frozen=True)
class Call:
  """One request, checked: its prompt ids, how many tokens at most, how to sample, where to stop."""

  kind: str  # COMPLETIONS or CHAT
  prompt: np.ndarray  # int32[L]
  max_tokens: int
  sampling: Sampling
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool


def _number(low: float, high: float, *, low_open: bool = False) -> Callable[[str, Any], float]:
  def check(name, value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low < value if low_open else low <= value) or value > high:
      bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
      raise RequestError(f"{name} must be a number in {bounds}, got {value!r}", name)
    return float(value)

  return check


def _count(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise RequestError(f"{name} must be a positive integer, got {value!r}", name)
  return value


def _top_k(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise RequestError(f"{name} must be an integer >= 0 (0: no top-k filter), got {value!r}", name)
  return value


def _flag(name, value):
  if not isinstance(value, bool):
    raise RequestError(f"{name} must be true or false, got {value!r}", name)
  return value


def _stop(name, value):
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
    raise RequestError(
      f"{name} must be a non-empty string or a list of at most {MAX_STOPS} of them, got {value!r}", name
    )
  return tuple(stops)


def _stream_options(name, value):
  if not isinstance(value, dict) or set(value) - {"include_usage"}:
    raise RequestError(f"{name} must be an object with only include_usage, got {value!r}", name)
  return _flag(f"{name}.include_usage", value.get("include_usage", False))


def _text(name, value):
  if not isinstance(value, str):
    raise RequestError(f"{name} must be a string, got {value!r}", name)
  return value


# Fields that both endpoints implement: name -> check (None: the value is not used).
FIELDS: dict[str, Callable | None] = {
  "model": _text,
  "max_tokens": _count,
  "temperature": _number(0, 2),
  "top_p": _number(0, 1, low_open=True),
  "top_k": _top_k,
  "stop": _stop,
  "stream": _flag,
  "stream_options": _stream_options,
  "user": _text,
}
# Fields of the API that kvjax does not implement, with the value that means "not used".
DEFAULTS = {
  "n": 1,
  "presence_penalty": 0,
  "frequency_penalty": 0,
  "logit_bias": None,
  "logprobs": None,
  "seed": None,
}
EXTRA = {
  COMPLETIONS: {"prompt", "echo", "best_of", "suffix"},
  CHAT: {"messages", "max_completion_tokens", "top_logprobs"},
}
EXTRA_DEFAULTS = {"echo": False, "best_of": 1, "suffix": None, "top_logprobs": None}


def parse(kind: str, body, tokenizer: TextTokenizer, max_len: int, model: str) -> Call:
  """A request body (JSON, decoded) -> its Call. Raises RequestError naming the field at fault."""
  if not isinstance(body, dict):
    raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
  known = set(FIELDS) | set(DEFAULTS) | EXTRA[kind]
  for name in body:
    if name not in known:
      raise RequestError(f"unknown field {name!r}; this endpoint takes {', '.join(sorted(known))}", name)
  for name, default in (DEFAULTS | EXTRA_DEFAULTS).items():
    value = body.get(name)
    if name in body and value is not None and value != default and not (name == "logprobs" and value is False):
      raise RequestError(f"{name}={value!r} is not supported by kvjax serve (only {default!r})", name)
  fields = {name: FIELDS[name](name, value) for name, value in body.items() if name in FIELDS and value is not None}
  if "model" not in fields:
    raise RequestError("model is required", "model")
  if fields["model"] != model:
    raise RequestError(f"model {fields['model']!r} is not served here; this server serves {model!r}", "model", 404)
  if "stream_options" in fields and not fields.get("stream", False):
    raise RequestError("stream_options is only allowed with stream=true", "stream_options")
  prompt = _prompt(body, tokenizer) if kind == COMPLETIONS else _chat_prompt(body, tokenizer)
  limit = body.get("max_completion_tokens") if kind == CHAT else None
  if limit is not None:
    fields.setdefault("max_tokens", _count("max_completion_tokens", limit))
  # OpenAI's defaults: 16 tokens for a completion, the room left in the context for a chat.
  room = max_len - prompt.size + 1
  if room < 1:
    raise RequestError(f"the prompt has {prompt.size} tokens, more than the server's max_len={max_len}", "prompt")
  max_tokens = fields.get("max_tokens", 16 if kind == COMPLETIONS else room)
  temperature = fields.get("temperature", 1.0)
  return Call(
    kind,
    prompt,
    max_tokens,
    Sampling(temperature, fields.get("top_k", 0), fields.get("top_p", 1.0)),
    fields.get("stop", ()),
    fields.get("stream", False),
    fields.get("stream_options", False),
  )


def _prompt(body: dict, tokenizer: TextTokenizer) -> np.ndarray:
  """A completion's prompt: one string (encoded with the tokenizer's bos) or one list of token ids."""
  if "prompt" not in body:
    raise RequestError("prompt is required", "prompt")
  prompt = body["prompt"]
  if isinstance(prompt, str):
    ids = tokenizer.encode(prompt, add_special_tokens=True)
  elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    ids = np.asarray(prompt, np.int64)
    bad = (ids < 0) | (ids >= tokenizer.vocab_size)
    if bad.any():
      i = int(np.argmax(bad))
      raise RequestError(
        f"prompt: token id {prompt[i]} at position {i} is outside [0, {tokenizer.vocab_size})", "prompt"
      )
  else:
    raise RequestError("prompt must be a string or a non-empty list of token ids (one prompt per request)", "prompt")
  if not len(ids):
    raise RequestError("prompt gives this model no tokens", "prompt")
  return np.asarray(ids, np.int32)


def _chat_prompt(body: dict, tokenizer: TextTokenizer) -> np.ndarray:
  """A chat's messages rendered by the model's chat template, the assistant's turn opened."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
  plain = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
      raise RequestError(f"{where} must be an object with role, content (and name), got {message!r}", where)
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
      raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    if isinstance(content, list):  # content parts: text only
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise RequestError(f"{where}.content: only text parts are supported", f"{where}.content")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    plain.append({"role": "system" if role == "developer" else role, "content": content})
  try:
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True)
  except ValueError as err:  # no template, or the template's own raise_exception
    raise RequestError(f"messages: {err}", "messages") from None
  return np.asarray(tokenizer.encode(text), np.int32)


class StopText:
  """The text of an answer as its tokens arrive, cut before the first of `stops`: `push` returns
  the text that is now certain (held back while it could still be the start of a stop sequence)."""

  def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
    self._decode, self._stops = decode, stops
    self._ids: list[int] = []
    self._sent = 0
    self.stopped = False

  def push(self, token: int) -> str:
    self._ids.append(int(token))
    return self._take(final=False)

  def flush(self) -> str:
    """The rest of the text once no token follows."""
    return self._take(final=True)

  def _take(self, final: bool) -> str:
    if self.stopped:
      return ""
    text = self._decode(self._ids)
    if not final and text.endswith("\ufffd"):  # a character cut by the token boundary
      text = text[:-1]
    hold = max((len(s) for s in self._stops), default=1) - 1
    start = max(0, self._sent - hold)
    cuts = [i for i in (text.find(s, start) for s in self._stops) if i >= 0]
    if cuts:
      self.stopped = True
      end = min(cuts)
    else:
      end = len(text) if final else len(text) - hold
    new, self._sent = text[self._sent : end], max(self._sent, end)
    return new


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


def response(call: Call, rid: str, created: int, model: str, text: str, finish: str, used: dict) -> dict:
  """The whole answer's body."""
  if call.kind == COMPLETIONS:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
  else:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
  return {"id": rid, "object": call.kind, "created": created, "model": model, "choices": [choice], "usage": used}


def _chunk_object(call: Call) -> str:
  return COMPLETIONS if call.kind == COMPLETIONS else "chat.completion.chunk"


def usage_chunk(call: Call, rid: str, created: int, model: str, used: dict) -> dict:
  """The last event of a stream asked for with stream_options.include_usage: no choices, the usage."""
  return {"id": rid, "object": _chunk_object(call), "created": created, "model": model, "choices": [], "usage": used}


def chunk(call: Call, rid: str, created: int, model: str, text: str | None, finish: str | None, first: bool) -> dict:
  """One server-sent event's body while streaming: a piece of text, or the finish reason."""
  if call.kind == COMPLETIONS:
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
  else:
    delta = {} if text is None else {"content": text}
    if first:
      delta = {"role": "assistant", **delta}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
  return {"id": rid, "object": _chunk_object(call), "created": created, "model": model, "choices": [choice]}
