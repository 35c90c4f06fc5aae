"""The engine on a thread of its own, for a server: other threads submit and cancel requests, and
each request's tokens reach its callback as they are sampled.

One thread owns the Engine and is the only one to touch it; the others send it commands through
a queue (submit, cancel, call). Between commands it steps the engine while any request is
waiting or running, and after each step hands every live request the tokens it gained. A
finished or cancelled request leaves the worker and the engine entirely (its pages freed, its
record dropped), so a server that runs for days holds only what is live.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from kvjax.decoding.sampling import Sampling
from kvjax.serving.engine import Engine
from kvjax.serving.requests import Request

# on_update(tokens, finished, error): the tokens sampled since the last call; finished once, at the
# end (a stop id, max_new_tokens, or an engine failure, whose message is `error`).
OnUpdate = Callable[[list[int], bool, "str | None"], None]


class EngineFailed(RuntimeError):
  """The engine raised while stepping: every live request ended with this error, and the worker
  takes no more requests (its state can no longer be trusted)."""


@dataclasses.dataclass
class _Live:
  request: Request
  on_update: OnUpdate
  sent: int = 0


class EngineWorker:
  """Runs `engine` on a daemon thread until `close`."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.failure: str | None = None
    self.cancelled = 0  # requests ended by `cancel` while the engine held them
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._live: dict[int, _Live] = {}
    self._thread = threading.Thread(target=self._loop, name="kvjax-engine", daemon=True)
    self._thread.start()

  @property
  def live(self) -> int:
    """Requests submitted and not yet finished or cancelled."""
    return len(self._live)

  # Any thread.

  def submit(self, prompt, max_new_tokens: int, sampling: Sampling | None, on_update: OnUpdate) -> Future:
    """Queues a request (as Engine.submit); the future holds its id, or the ValueError that
    refused it (a bad token id, a prompt too long for max_len or for the page pool)."""
    return self._send("submit", (prompt, max_new_tokens, sampling, on_update))

  def cancel(self, request_id: int) -> None:
    """Ends a request now, freeing its pages; its callback is not called again."""
    self._send("cancel", request_id)

  def call(self, fn: Callable[[Engine], Any]) -> Future:
    """fn(engine) run on the engine's thread between steps (for counters: the free pages, the
    requests held); the future holds what it returns."""
    return self._send("call", fn)

  def close(self) -> None:
    """Stops the thread after the commands already sent; requests still live are dropped."""
    if self._thread.is_alive():
      self._send("close", None)
      self._thread.join()

  def _send(self, command: str, payload) -> Future:
    future: Future = Future()
    if not self._thread.is_alive():
      future.set_exception(RuntimeError("the engine worker is closed"))
    else:
      self._inbox.put((command, payload, future))
    return future

  # The engine's thread.

  def _loop(self) -> None:
    engine = self.engine
    while True:
      busy = bool(engine.waiting or engine.running)
      try:
        command = self._inbox.get(block=not busy)
      except queue.Empty:
        command = None
      while command is not None:
        if command[0] == "close":
          command[2].set_result(None)
          return
        self._handle(*command)
        try:
          command = self._inbox.get_nowait()
        except queue.Empty:
          command = None
      if engine.waiting or engine.running:
        self._step()

  def _handle(self, command: str, payload, future: Future) -> None:
    engine = self.engine
    try:
      if command == "submit":
        if self.failure is not None:
          raise EngineFailed(self.failure)
        prompt, max_new_tokens, sampling, on_update = payload
        request_id = engine.submit(prompt, max_new_tokens, sampling)
        self._live[request_id] = _Live(engine.waiting[-1], on_update)
        future.set_result(request_id)
      elif command == "cancel":
        if self._live.pop(payload, None) is not None:
          engine.cancel(payload)
          self.cancelled += 1
        future.set_result(None)
      else:
        future.set_result(payload(engine))
    except Exception as err:  # handed to the caller, who answers its client
      future.set_exception(err)

  def _step(self) -> None:
    engine = self.engine
    idle, prefills = not engine.running, engine.stats.prefills
    try:
      engine.step()
    except Exception as err:
      self._fail(f"{type(err).__name__}: {err}")
      return
    if idle and engine.stats.prefills == prefills:  # Engine.submit admits only what the pool can hold
      self._fail(f"request {engine.waiting[0].id} cannot be admitted into an idle engine")
      return
    for request_id, live in list(self._live.items()):
      generated = live.request.generated
      finished = engine.finished.pop(request_id, None) is not None
      if finished or len(generated) > live.sent:
        new, live.sent = generated[live.sent :], len(generated)
        if finished:
          del self._live[request_id]
        self._notify(request_id, live, list(new), finished, None)

  def _fail(self, message: str) -> None:
    """Ends every live request with the engine's error and refuses new ones."""
    self.failure = message
    for request_id, live in list(self._live.items()):
      self.engine.cancel(request_id)
      self._notify(request_id, live, [], True, message)
    self._live.clear()

  def _notify(self, request_id: int, live: _Live, tokens: list[int], finished: bool, error: str | None) -> None:
    """live.on_update(...); a callback that raises (its client gone) cancels its request."""
    try:
      live.on_update(tokens, finished, error)
    except Exception:
      if self._live.pop(request_id, None) is not None:
        self.engine.cancel(request_id)
