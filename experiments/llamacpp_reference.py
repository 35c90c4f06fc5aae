"""llama.cpp (through llama-cpp-python) decoding a model at batch 1, the reference for `kvjax bench
real`'s llama.cpp rows. Runs in llama-cpp-python's own environment (it imports neither jax nor
kvjax) and prints JSON.

  python experiments/llamacpp_reference.py --gguf MODEL.gguf --format q8_0 \
      --prompt-ids 1,2,3 --new-tokens 128 --threads 2 --repeats 3

The model is first written in the format asked for, once, into --cache-dir (default
~/.cache/kvjax/llamacpp, named `<stem>.<format>.gguf`) by llama.cpp's own quantizer
(`llama_model_quantize`, allow_requantize: each tensor of the source is dequantized and stored
again): `f32` holds the source's weights exactly as kvjax's float32 import dequantizes them, `q8_0`
is llama.cpp's 8-bit blocks (32 weights and one scale) of those. One round: the prompt through
llama_decode in one batch, its last logits' argmax, then one token per llama_decode for the rest
(greedy, no sampler): `prefill_s` is the first part, `decode_s` the rest, `request_s` both.

--serve loads the model, prints one JSON line (the settings), then runs one round per line read
from stdin and prints its JSON line, until stdin closes: the caller times its own calls between
ours, alternating rounds in one run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

FTYPES = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def convert(source: Path, fmt: str, cache_dir: Path, threads: int) -> Path:
  """The GGUF of `source` with every weight in `fmt`, written once into cache_dir."""
  out = cache_dir / f"{source.stem}.{fmt}.gguf"
  if out.exists():
    return out
  cache_dir.mkdir(parents=True, exist_ok=True)
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = FTYPES[fmt]
  params.nthread = threads
  params.allow_requantize = True
  params.quantize_output_tensor = True
  partial = out.with_suffix(".partial")
  if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
    raise SystemExit(f"llama_model_quantize could not write {fmt} from {source}")
  partial.rename(out)
  return out


class Reference:
  """One llama.cpp model and context sized for one request, decoded greedily."""

  def __init__(self, path: Path, prompt: list[int], new_tokens: int, threads: int):
    self.prompt, self.new_tokens = prompt, new_tokens
    self.llm = llama_cpp.Llama(
      model_path=str(path),
      n_ctx=len(prompt) + new_tokens,
      n_batch=max(len(prompt), 1),
      n_ubatch=max(len(prompt), 1),
      n_threads=threads,
      n_threads_batch=threads,
      logits_all=False,
      verbose=False,
    )
    self.vocab = self.llm.n_vocab()

  def _next(self, tokens: list[int]) -> int:
    self.llm.eval(tokens)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab,))
    return int(np.argmax(logits))

  def round(self) -> dict:
    self.llm.reset()
    start = time.perf_counter()
    token = self._next(self.prompt)
    prefill_s = time.perf_counter() - start
    ids = [token]
    while len(ids) < self.new_tokens:
      ids.append(self._next([ids[-1]]))
    request_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_s": request_s - prefill_s, "request_s": request_s, "generated_ids": ids}


def summary(rounds: list[dict], new_tokens: int) -> dict:
  """Medians over rounds: tokens/s over the whole request (as kvjax's generate is timed) and over
  the decode phase alone."""
  med = {k: statistics.median(r[k] for r in rounds) for k in ("prefill_s", "decode_s", "request_s")}
  return {
    **med,
    "tokens_per_s": new_tokens / med["request_s"],
    "decode_tokens_per_s": (new_tokens - 1) / med["decode_s"] if new_tokens > 1 else None,
    "seconds": [r["request_s"] for r in rounds],
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", type=Path, required=True, help="the model's GGUF (any weight types)")
  parser.add_argument("--format", choices=sorted(FTYPES), required=True)
  parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "kvjax" / "llamacpp")
  parser.add_argument("--serve", action="store_true", help="one round per line of stdin (see the docstring)")
  args = parser.parse_args(argv)
  prompt = [int(t) for t in args.prompt_ids.split(",")]
  if not args.gguf.is_file():
    raise SystemExit(f"--gguf {args.gguf}: no such file")
  if args.new_tokens < 1 or args.repeats < 1 or args.threads < 1:
    raise SystemExit("--new-tokens, --repeats and --threads must be at least 1")
  path = convert(args.gguf, args.format, args.cache_dir, args.threads)
  ref = Reference(path, prompt, args.new_tokens, args.threads)
  if not 0 <= min(prompt) <= max(prompt) < ref.vocab:
    raise SystemExit(f"--prompt-ids: every id must be in [0, {ref.vocab}), got {min(prompt)}..{max(prompt)}")
  settings = {
    "llama_cpp_version": llama_cpp.__version__,
    "gguf": str(path),
    "format": args.format,
    "threads": args.threads,
    "prompt_tokens": len(prompt),
    "new_tokens": args.new_tokens,
  }
  if args.serve:
    print(json.dumps(settings), flush=True)
    for _ in sys.stdin:
      print(json.dumps(ref.round()), flush=True)
    return
  ref.round()  # warm-up
  rounds = [ref.round() for _ in range(args.repeats)]
  print(json.dumps({**settings, **summary(rounds, args.new_tokens), "generated_ids": rounds[-1]["generated_ids"]}))


if __name__ == "__main__":
  main()
