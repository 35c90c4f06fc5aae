"""llama.cpp as a peer of `kvjax bench real`: experiments/llamacpp_reference.py run by another Python
(llama-cpp-python's own environment, never kvjax's) as a subprocess that decodes one round per line
it reads, so its rounds alternate with kvjax's in one timed_alternating loop.

The script writes the model's GGUF in the format asked for (f32, q8_0) once into its cache folder
with llama.cpp's quantizer; its first output line names that file.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "llamacpp_reference.py"
# llama.cpp's formats beside the kvjax weight format that stores the same kind of numbers.
FORMATS = {"f32": "float32", "q8_0": "int8"}


def check_python(python: str | None) -> str | None:
  """Why the llama.cpp rows cannot run with `python` (None: they can); a missing interpreter is
  the user's mistake, refused with a ValueError naming it."""
  if python is None:
    return "not asked for: give --llamacpp-python, the Python of an environment with llama-cpp-python"
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    raise ValueError(f"--llamacpp-python {python}: not an executable file")
  if not SCRIPT.is_file():
    return f"{SCRIPT} is missing (kvjax runs from a checkout for its experiments/ scripts)"
  return None


class LlamaCppPeer:
  """One llama.cpp model in a subprocess, decoding `prompt` (int ids [P]) greedily for `new_tokens`
  at batch 1 on `threads` threads. Calling it runs one round and returns its generated ids [1, N];
  `rounds` keeps each round's own figures (prefill_s, decode_s, request_s)."""

  def __init__(self, python: str, gguf: Path, fmt: str, prompt: np.ndarray, new_tokens: int, threads: int = 2):
    ids = ",".join(str(int(t)) for t in prompt)
    argv = [python, str(SCRIPT), "--gguf", str(gguf), "--format", fmt, "--prompt-ids", ids, "--serve"]
    argv += ["--new-tokens", str(new_tokens), "--threads", str(threads)]
    self.process = subprocess.Popen(
      argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    self.settings = self._read()
    self.rounds: list[dict] = []

  def _read(self) -> dict:
    line = self.process.stdout.readline()
    if not line:
      self.process.kill()
      err = self.process.stderr.read().strip().splitlines()[-5:]
      raise RuntimeError(f"llama.cpp reference stopped: {' | '.join(err)}")
    return json.loads(line)

  def __call__(self) -> np.ndarray:
    self.process.stdin.write("round\n")
    self.process.stdin.flush()
    out = self._read()
    self.rounds.append({k: out[k] for k in ("prefill_s", "decode_s", "request_s")})
    return np.asarray([out["generated_ids"]])

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait(timeout=60)
    self.process.stderr.close()
    self.process.stdout.close()

  def figures(self) -> dict:
    """llama.cpp's own timing of the timed rounds (the first round is timed_alternating's warm-up)."""
    timed = self.rounds[1:] or self.rounds
    med = {k: float(np.median([r[k] for r in timed])) for k in ("prefill_s", "decode_s")}
    new_tokens = self.settings["new_tokens"]
    return {
      **{k: self.settings[k] for k in ("llama_cpp_version", "gguf", "threads")},
      "own_prefill_s": med["prefill_s"],
      "own_decode_tokens_per_s": (new_tokens - 1) / med["decode_s"] if new_tokens > 1 else None,
    }
