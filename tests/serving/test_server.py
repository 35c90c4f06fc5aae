"""`kvjax serve`'s HTTP server, through the official `openai` client over loopback: every answer is
the text of `generate`'s greedy tokens (cut at a stop id or stop sequence), streamed or whole; a
client that leaves frees its pages; a bad request gets one 4xx line and the server keeps serving.

The model has random weights and SmolLM2's tokenizer (its vocabulary, chat template and stop
ids), so the answers are arbitrary text that the oracle still pins token for token."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import kvjax
from kvjax.cache.config import CacheConfig
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.serving.worker import EngineWorker
from conftest import init_params, tiny_config

openai = pytest.importorskip("openai")

MAX_LEN = 1024
PAD = 64  # the oracle's prompt width
MODEL = "tiny-smollm2-vocab"
PROMPTS = ("The KV cache holds", "Paged attention splits the cache into", "def fibonacci(n):")


@pytest.fixture(scope="module")
def served(smollm2):
  from kvjax.serving.server import create_app, running

  tokenizer = TextTokenizer.load(smollm2)
  model, params = init_params(tiny_config(2, vocab_size=tokenizer.vocab_size, max_len=MAX_LEN))
  config = EngineConfig(
    num_slots=4,
    num_pages=4 * (MAX_LEN // 16) + 1,
    max_len=MAX_LEN,
    cache=CacheConfig(layout="paged", page_size=16),
    stop_ids=tuple(tokenizer.stop_ids),
  )
  worker = EngineWorker(Engine(model, params, config))
  with running(create_app(worker, tokenizer, MODEL)) as port:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
    yield {"client": client, "port": port, "worker": worker, "tokenizer": tokenizer, "model": model, "params": params}
  worker.close()


def greedy(served, prompt_ids, max_new_tokens):
  """`generate`'s greedy tokens alone (the contiguous cache), up to and including a stop id; the
  prompt right-padded to PAD and 40 tokens made, so that one compilation serves every call."""
  model, params, stops = served["model"], served["params"], served["tokenizer"].stop_ids
  tokens = np.zeros((1, PAD), np.int32)
  tokens[0, : len(prompt_ids)] = prompt_ids
  out = kvjax.generate(model, params, tokens, np.array([len(prompt_ids)]), 40, stop_ids=stops)
  ids = [int(t) for t in np.asarray(out)[0, :max_new_tokens]]
  for i, t in enumerate(ids):
    if t in stops:
      return ids[: i + 1], "stop"
  return ids, "length"


def expected_text(served, prompt_ids, max_new_tokens):
  ids, finish = greedy(served, prompt_ids, max_new_tokens)
  text = served["tokenizer"].decode([t for t in ids if t not in served["tokenizer"].stop_ids])
  return text, finish, len(ids)


def wait_until_idle(worker, timeout=60.0):
  """The engine's (free pages, usable pages, requests held) once it holds none, within timeout."""
  deadline = time.time() + timeout
  while True:
    state = worker.call(lambda e: (e.allocator.num_free, e.allocator.num_usable, len(e.running) + len(e.waiting)))
    state = state.result()
    if state[2] == 0 or time.time() > deadline:
      return state
    time.sleep(0.1)


def test_completions_whole_and_streamed_are_generates_tokens(served):
  client, tok = served["client"], served["tokenizer"]
  results = {}

  def ask(i, prompt):  # three clients at once: they share the engine's decode steps
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    results[i] = (whole, [c.choices[0] for c in stream])

  threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for i, prompt in enumerate(PROMPTS):
    ids = tok.encode(prompt, add_special_tokens=True)
    text, finish, count = expected_text(served, ids, 24)
    whole, chunks = results[i]
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == finish
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), count)
    assert "".join(c.text for c in chunks) == text and chunks[-1].finish_reason == finish
  free, usable, held = wait_until_idle(served["worker"])
  assert held == 0 and free == usable


def test_chat_completion_reads_the_chat_template(served):
  client, tok = served["client"], served["tokenizer"]
  messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a KV cache?"}]
  ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
  text, finish, count = expected_text(served, ids, 20)
  answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
  assert answer.choices[0].message.content == text and answer.choices[0].finish_reason == finish
  assert answer.usage.completion_tokens == count
  stream = client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
  )
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
  assert chunks[-1].usage.completion_tokens == count and chunks[-1].usage.prompt_tokens == len(ids)


def test_stop_sequences_cut_the_text_and_end_the_request(served):
  client, tok = served["client"], served["tokenizer"]
  prompt = PROMPTS[1]
  text, _, _ = expected_text(served, tok.encode(prompt, add_special_tokens=True), 40)
  stop = text[len(text) // 2 : len(text) // 2 + 3]
  assert stop, "the oracle's answer is too short to hold a stop sequence"
  want = text[: text.find(stop)]
  whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00\x01"])
  assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
  stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True)
  assert "".join(c.choices[0].text for c in stream) == want
  free, usable, held = wait_until_idle(served["worker"])
  assert held == 0 and free == usable


@pytest.mark.tier2  # Engine.cancel's oracle is in the first tier (tests/serving/test_engine.py)
def test_a_client_that_leaves_frees_its_pages(served):
  worker = served["worker"]
  held = lambda: worker.call(lambda e: len(e.running) + len(e.waiting)).result()  # noqa: E731
  cancelled = worker.cancelled
  # 400 tokens take this engine seconds: each client below leaves long before its answer ends.
  body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0.7}
  # Streamed: read two events, then close the connection.
  stream = served["client"].completions.create(**body, stream=True)
  next(iter(stream)), next(iter(stream))
  stream.close()
  # Whole: send the request, wait until the engine holds it, close the socket unread.
  with socket.create_connection(("127.0.0.1", served["port"])) as sock:
    raw = json.dumps(body).encode()
    sock.sendall(
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      + f"Content-Length: {len(raw)}\r\n\r\n".encode()
      + raw
    )
    while not held():
      time.sleep(0.02)
  free, usable, left = wait_until_idle(worker)
  assert left == 0 and free == usable
  assert worker.cancelled == cancelled + 2  # both ended by their client, not by max_tokens
  worker.call(lambda e: e.allocator.check()).result()
  assert not worker.call(lambda e: e.finished).result()  # nothing kept for a client that left


def post(port, path, data: bytes):
  request = urllib.request.Request(
    f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
  )
  try:
    with urllib.request.urlopen(request, timeout=60) as answer:
      return answer.status, json.loads(answer.read())
  except urllib.error.HTTPError as err:
    return err.code, json.loads(err.read())


@pytest.mark.parametrize(
  "body, status, message",
  [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temprature": 0}).encode(), 400, "unknown field 'temprature'"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model 'gpt-4' is not served here"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 2}).encode(), 400, "n=2 is not supported"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(), 400, "temperature must be a number"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens must be a positive"),
    (json.dumps({"model": MODEL, "prompt": [1, 10**9]}).encode(), 400, "token id 1000000000 at position 1"),
    (json.dumps({"model": MODEL, "prompt": "x " * 1100}).encode(), 400, "more than the server's max_len=1024"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1100}).encode(), 400, "more than max_len=1024"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "at most 4"),
  ],
)
def test_bad_requests_get_one_line_and_the_server_keeps_serving(served, body, status, message):
  code, answer = post(served["port"], "/v1/completions", body)
  assert code == status and message in answer["error"]["message"] and "\n" not in answer["error"]["message"]
  assert served["client"].completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0).choices


def test_bad_chat_messages_and_paths(served):
  port = served["port"]
  code, answer = post(
    port, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode()
  )
  assert code == 400 and "messages[0].role must be one of" in answer["error"]["message"]
  code, answer = post(port, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
  assert code == 400 and "messages must be a non-empty list" in answer["error"]["message"]
  code, answer = post(port, "/v1/embeddings", b"{}")
  assert code == 404 and "/v1/embeddings" in answer["error"]["message"]
  with pytest.raises(openai.BadRequestError, match="unknown field 'tools'"):
    served["client"].chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"tools": []}
    )
  assert [m.id for m in served["client"].models.list()] == [MODEL]
