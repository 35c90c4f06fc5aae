"""Building the CPU kernels: no compiler means one warning and the same tokens through XLA;
concurrent first uses share one build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import kvjax
from conftest import init_params, tiny_config

GENERATE = """
import json, warnings
import numpy as np
import jax
import kvjax
from kvjax.decoding.decode import for_decoding
from kvjax.model.backend import XLA
config = kvjax.ModelConfig(**json.loads({config!r}))
model = kvjax.Transformer(config)
params = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
prompts = np.arange(12, dtype=np.int32).reshape(2, 6) % config.vocab_size
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  tokens = [np.asarray(kvjax.generate(model, params, prompts, np.array([6, 4]), 8)).tolist() for _ in range(2)]
  _, cache = kvjax.prefill(model, params, prompts, np.array([6, 4]), 16)
  kvjax.decode_step(model, params, cache, np.array([1, 2]))
warned = [str(w.message) for w in caught if "CPU kernels are unavailable" in str(w.message)]
print(json.dumps({{"tokens": tokens, "warned": warned, "xla": for_decoding(model).backend == XLA}}))
"""


def run_python(code: str, **env) -> str:
  done = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def test_without_a_compiler_warns_once_and_gives_the_same_tokens(tmp_path):
  config = tiny_config(2)
  model, params = init_params(config)
  prompts = np.arange(12, dtype=np.int32).reshape(2, 6) % config.vocab_size
  expected = np.asarray(kvjax.generate(model, params, prompts, np.array([6, 4]), 8)).tolist()
  code = GENERATE.format(config=json.dumps(config.to_dict()))
  out = json.loads(run_python(code, CXX="/nonexistent", KVJAX_CACHE=str(tmp_path)).splitlines()[-1])
  assert out["xla"] and out["tokens"] == [expected, expected]
  assert len(out["warned"]) == 1 and "/nonexistent" in out["warned"][0]
  assert not list(tmp_path.glob("*.so"))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
@pytest.mark.tier2
def test_concurrent_first_builds_share_one_library(tmp_path):
  code = "import json; from kvjax.kernels import build; print(json.dumps(build.build()))"
  env = {**os.environ, "KVJAX_CACHE": str(tmp_path)}
  procs = [
    subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(2)
  ]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    results.append(json.loads(out.splitlines()[-1]))
  assert results[0] == results[1] and sorted(results[0]["kernels"]) == ["attention", "matmul"]
  assert [p.name for p in tmp_path.glob("*.so")] == [os.path.basename(results[0]["library"])]
