"""`kvjax serve`: its options make the engine's settings (a press by name at a ratio, a codec, a
pool of num_slots full-length requests), a bad option is one error line before any model loads,
and the command serves an imported SmolLM2 over loopback to the `openai` client with the
answers of the engine those options make (tier 2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import SnapKV
from kvjax.cli import main as cli
from kvjax.cli.serve import engine_config
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.serving.engine import Engine
from kvjax.training.checkpoint import load_model


def options(*flags: str):
  return cli.parse_args(["serve", "--workdir", "runs/none", *flags])


def test_the_options_make_the_engines_settings():
  config = engine_config(options("--press", "snapkv", "--ratio", "0.75", "--codec", "int8", "--num-slots", "4"), 2048)
  assert config.cache == CacheConfig(layout="paged_evict", dtype="int8", press=SnapKV(compression_ratio=0.75))
  assert (config.num_slots, config.max_len, config.num_pages) == (4, 2048, 4 * 2048 // 16 + 1)
  config = engine_config(options("--set", "cache.page_size=32", "max_len=512", "weights=int8"), 8192)
  assert config.cache == CacheConfig(layout="paged", page_size=32) and config.weights == "int8"
  assert config.num_pages == 8 * 512 // 32 + 1
  assert engine_config(options("--set", "num_pages=9"), 8192).num_pages == 9


@pytest.mark.parametrize(
  "flags, clue",
  [
    (["--ratio", "0.5"], "--ratio sets the press's compression ratio; name the press with --press"),
    (["--codec", "int3"], "CacheConfig.dtype must be one of"),
    (["--set", "num_slot=2"], "unknown config key 'num_slot'"),
    (["--press", "snapkv", "--set", "allocation='doubling'"], "with CacheConfig.press the engine allocates 'paged'"),
    (["--port", "70000"], "argument --port: must be a TCP port from 1 up to 65,535"),
    (["--ratio", "1"], "argument --ratio: must be a compression ratio in [0, 1)"),
  ],
)
def test_a_bad_option_is_one_error_line(capsys, flags, clue):
  try:
    code = cli.main(["serve", "--workdir", "runs/none", *flags])
  except SystemExit as stopped:
    code = stopped.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and err[-1].startswith("kvjax serve: error:") and clue in err[-1]


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@pytest.mark.tier2
def test_kvjax_serve_answers_an_openai_client_as_its_engine(smollm2):
  openai = pytest.importorskip("openai")
  port = free_port()
  flags = ["--press", "snapkv", "--ratio", "0.5", "--codec", "int8", "--num-slots", "2", "--set", "max_len=512"]
  server = subprocess.Popen(
    [sys.executable, "-m", "kvjax.cli.main", "serve", "--workdir", str(smollm2), "--port", str(port), *flags],
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)
    deadline = time.time() + 300
    while True:
      try:
        name = client.models.list().data[0].id
        break
      except openai.APIConnectionError:
        assert server.poll() is None and time.time() < deadline, server.stderr.read()
        time.sleep(1)
    assert name == smollm2.name
    # A prompt of about 300 tokens, so that SnapKV (its window 64) drops half of it.
    document = " ".join(f"Box {i} holds {i * 7 % 13} red balls." for i in range(30))
    messages = [{"role": "user", "content": document + " Which box holds the most red balls?"}]
    answer = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
  finally:
    server.terminate()
    server.wait(60)
  # The oracle: the engine in this process with the settings those options make. (Engine against
  # generate under the same press and codec is tests/serving/test_engine_press.py; here the two
  # would part at this prompt's 13th token, where the two best logits are 7e-4 apart and the paged
  # and contiguous decode kernels sum in different orders.)
  model, params, _ = load_model(smollm2)
  tokenizer = TextTokenizer.load(smollm2)
  config = engine_config(options(*flags), model.config.max_len, tokenizer.stop_ids)
  assert config.cache == CacheConfig(layout="paged_evict", dtype="int8", press=SnapKV(compression_ratio=0.5))
  engine = Engine(model, params, config)
  ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
  request = engine.submit(np.asarray(ids), 24)
  tokens = [int(t) for t in engine.run()[request]]
  ends = [i for i, t in enumerate(tokens) if t in tokenizer.stop_ids]
  want = tokenizer.decode(tokens[: ends[0]] if ends else tokens)
  assert answer.choices[0].message.content == want and want
