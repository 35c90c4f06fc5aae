"""`kvjax serve`'s HTTP server: the OpenAI API's completions and chat completions over one
engine (kvjax.serving.worker), streamed as server-sent events when asked.

A request is checked (kvjax.serving.api), submitted to the engine's thread and answered from the
tokens that thread hands back. A client that goes away (a closed stream, a dropped connection
while waiting for a whole answer) cancels its request, which frees its pages. A refused request
gets a 4xx answer of one line in the API's error shape and the server keeps serving; an engine
failure ends the requests it held with a 500 and the server refuses new ones with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvjax.interop.tokenizer import TextTokenizer
from kvjax.serving import api
from kvjax.serving.worker import EngineFailed, EngineWorker

MAX_BODY = 8 << 20  # bytes of a request body; a prompt of max_len tokens is far less
DISCONNECT_POLL = 0.25  # seconds between checks for a gone client while a whole answer is made


def create_app(worker: EngineWorker, tokenizer: TextTokenizer, model: str) -> Starlette:
  """The server's application (an ASGI app: run it with uvicorn) for `model` (the name clients
  send) served by `worker`'s engine, whose stop ids end an answer."""
  engine = worker.engine
  max_len, stop_ids = engine.max_len, set(engine.config.stop_ids)
  created = int(time.time())

  async def models(request: Request):
    entry = {"id": model, "object": "model", "created": created, "owned_by": "kvjax", "max_model_len": max_len}
    return JSONResponse({"object": "list", "data": [entry]})

  async def health(request: Request):
    return JSONResponse({"status": "ok" if worker.failure is None else "failed"})

  async def completions(request: Request):
    return await _serve(request, api.COMPLETIONS)

  async def chat(request: Request):
    return await _serve(request, api.CHAT)

  async def _serve(request: Request, kind: str):
    try:
      body = await _read_json(request)
      call = api.parse(kind, body, tokenizer, max_len, model)
      answer = _Answer(worker, tokenizer, call, stop_ids)
      await answer.start()
    except api.RequestError as err:
      return JSONResponse(err.body(), status_code=err.status)
    except EngineFailed as err:
      return _error(503, f"the engine failed earlier and serves no more requests: {err}")
    rid = f"{'cmpl' if kind == api.COMPLETIONS else 'chatcmpl'}-{uuid.uuid4().hex}"
    now = int(time.time())
    if call.stream:
      return StreamingResponse(_events(answer, call, rid, now), media_type="text/event-stream")
    try:
      text, finish = await answer.whole(request)
    except _Gone:
      return _error(499, "the client closed the connection")
    if finish == "error":
      return _error(500, answer.error)
    used = api.usage(call.prompt.size, answer.generated)
    return JSONResponse(api.response(call, rid, now, model, text, finish, used))

  async def _events(answer: _Answer, call: api.Call, rid: str, now: int):
    first = True
    try:
      async for text, finish in answer.pieces():
        if finish == "error":
          yield _sse({"error": {"message": answer.error, "type": "server_error", "param": None, "code": None}})
          break
        if text:
          yield _sse(api.chunk(call, rid, now, model, text, None, first))
          first = False
        if finish is not None:
          yield _sse(api.chunk(call, rid, now, model, None, finish, first))
          if call.include_usage:
            yield _sse(api.usage_chunk(call, rid, now, model, api.usage(call.prompt.size, answer.generated)))
      yield "data: [DONE]\n\n"
    finally:  # the client gone mid-stream: the generator is closed here
      answer.cancel()

  async def not_found(request: Request, exc: HTTPException):
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

  routes = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
  ]
  return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0):
  """Serves `app` with uvicorn on a thread of this process until the block ends (port 0: a free
  one); yields the port it listens on. For research code and tests that talk to a server they
  started themselves."""
  import uvicorn

  server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
  thread = threading.Thread(target=server.run, name="kvjax-server", daemon=True)
  thread.start()
  while not server.started:
    if not thread.is_alive():
      raise OSError(f"kvjax serve could not listen on {host}:{port}")
    time.sleep(0.05)
  try:
    yield server.servers[0].sockets[0].getsockname()[1]
  finally:
    server.should_exit = True
    thread.join()


class _Gone(Exception):
  """The client closed its connection before its answer was whole."""


class _Answer:
  """One request in the engine: its tokens as they come, turned into text cut at its stops."""

  def __init__(self, worker: EngineWorker, tokenizer: TextTokenizer, call: api.Call, stop_ids: set[int]):
    self.worker, self.call, self.stop_ids = worker, call, stop_ids
    self.text = api.StopText(tokenizer.decode, call.stop)
    self.generated = 0
    self.error: str | None = None
    self._id: int | None = None
    self._done = False
    self._updates: asyncio.Queue = asyncio.Queue()

  async def start(self) -> None:
    loop = asyncio.get_running_loop()

    def on_update(tokens, finished, error):  # on the engine's thread
      loop.call_soon_threadsafe(self._updates.put_nowait, (tokens, finished, error))

    future = self.worker.submit(self.call.prompt, self.call.max_tokens, self.call.sampling, on_update)
    try:
      self._id = await asyncio.wrap_future(future)
    except ValueError as err:  # the engine's refusal: too long for max_len or the pool, a bad id
      raise api.RequestError(str(err), "prompt") from None

  async def pieces(self):
    """Yields (text, finish): text that is certain, and once a finish reason ("stop", "length",
    "error") with the last of the text."""
    while not self._done:
      tokens, finished, error = await self._updates.get()
      if error is not None:
        self._done, self.error = True, error
        yield "", "error"
        return
      pieces, finish = [], None
      for token in tokens:
        self.generated += 1
        if token in self.stop_ids:
          finish = "stop"
          break
        pieces.append(self.text.push(token))
        if self.text.stopped:
          finish = "stop"
          break
      if finish is None and finished:
        finish = "length"
      if finish is not None:
        self._done = True
        pieces.append(self.text.flush())
        if not finished:
          self.cancel()
      yield "".join(pieces), finish

  async def whole(self, request: Request) -> tuple[str, str]:
    """The whole text and its finish reason; raises _Gone (having cancelled) if the client leaves."""
    parts, finish = [], None
    stream = self.pieces()
    while finish is None:
      step = asyncio.ensure_future(stream.__anext__())
      while True:
        done, _ = await asyncio.wait({step}, timeout=DISCONNECT_POLL)
        if done:
          break
        if await request.is_disconnected():
          step.cancel()
          self.cancel()
          raise _Gone()
      text, finish = step.result()
      parts.append(text)
    return "".join(parts), finish

  def cancel(self) -> None:
    """Frees the request's pages if it is still in the engine (idempotent)."""
    if self._id is not None:
      self.worker.cancel(self._id)
      self._id = None


async def _read_json(request: Request):
  size = int(request.headers.get("content-length") or 0)
  if size > MAX_BODY:
    raise api.RequestError(f"the request body has {size} bytes, more than the server takes ({MAX_BODY})", None, 413)
  raw = b""
  async for part in request.stream():
    raw += part
    if len(raw) > MAX_BODY:
      raise api.RequestError(f"the request body is longer than the server takes ({MAX_BODY} bytes)", None, 413)
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise api.RequestError(f"the request body is not valid JSON: {err}") from None


def _sse(body: dict) -> str:
  return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error(status: int, message: str) -> JSONResponse:
  kind = "server_error" if status >= 500 else "invalid_request_error"
  return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)
