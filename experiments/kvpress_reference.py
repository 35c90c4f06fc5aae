"""NVIDIA kvpress on kvjax's own long-context samples, token for token: the per-sample reference
that kvjax's presses are compared with (kvjax.studies.press_table, docs/results.md).

kvjax writes the samples (WORKDIR/samples.jsonl: context_ids, question_ids, answer_tokens,
stop_ids and answer_end per sample); this script feeds exactly those ids to `transformers`
(float32, loaded from the same GGUF file; eager attention for the press that reads attention
weights, SDPA otherwise, as kvpress requires) under each kvpress press, and writes each greedy
answer as token ids, one JSON line per (sample, press, ratio, protocol), with the seconds that
sample's prefill and generation took ("seconds", wall time). kvjax decodes and scores them with
the scorer it uses for its own answers, so the two sides differ only in the model runtime and the
press. A sample whose answer ends at its first line (answer_end "line": a base model's) stops
decoding at that line break, as kvjax does.

Protocols: query_agnostic (kvpress's own: the press runs while the context is prefilled, then
the question is read into the pressed cache) and query_aware (the whole prompt is pressed).
A Gemma 3 model is pressed on its global layers only, kvpress's rule for Gemma 3 (its
sliding-window layers keep their window).

It imports neither jax nor kvjax: run it in an environment with kvpress (which pins its own
transformers), e.g.
  python -m venv kvp && kvp/bin/pip install torch==2.13.0  # first, so pip keeps this (CPU) torch
  kvp/bin/pip install kvpress==0.5.5 gguf -c <(echo torch==2.13.0)
  kvp/bin/python experiments/kvpress_reference.py --gguf MODEL.gguf --samples W/samples.jsonl \
      --out W/kvpress.jsonl --presses snapkv,tova --ratios 0.5,0.75
A rerun appends only the answers the output file lacks.

Which samples: all of them, or with `--draw N` a seeded draw of N per context length (the
samples' "length"), not the first ones: random.Random(--seed, default 0) draws
`rng.sample(that length's samples in file order, N)` for each length in ascending order, one
generator across the lengths, and the drawn samples are answered in file order. The same file,
N and seed draw the same samples on every run (so a rerun resumes the same draw); a length with
fewer than N samples is an error. `--limit M` then keeps the first M of those (of all samples
without --draw).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import pathlib
import random
import sys
import time

import numpy
import torch
import transformers

import kvpress
from kvpress.presses import kvzip_press, leverage_press

PROTOCOLS = ("query_agnostic", "query_aware")


def make_press(name: str, ratio: float):
  """kvpress's press for kvjax's press name (kvjax.cache.presses), with kvjax's default fields;
  `name:adaptive` wraps it in AdaKV's head-adaptive budgets; `snapkv:pyramid` is PyramidKVPress
  (SnapKV under PyramidKV's per-layer budgets, the only pyramid kvpress has)."""
  if name == "snapkv:pyramid":
    return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=64, kernel_size=5, beta=20)
  base, _, heads = name.partition(":")
  scorers = {
    "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
    "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
    "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
    "observed": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
    "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
    "random": lambda: kvpress.RandomPress(compression_ratio=ratio, seed=0),
    "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=ratio),
    "expected_attention": lambda: kvpress.ExpectedAttentionPress(
      compression_ratio=ratio, n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0.0
    ),
    "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio),
    "cur": lambda: kvpress.CURPress(
      compression_ratio=ratio, num_sinks=4, leverage_type="kv_product", local_window_size=16
    ),
    "lagkv": lambda: kvpress.LagKVPress(compression_ratio=ratio, n_sink=4, lag_size=128),
    "leverage": lambda: kvpress.LeverageScorePress(compression_ratio=ratio, sketch_dimension=48),
    "compactor": lambda: kvpress.CompactorPress(
      compression_ratio=ratio, sink_size_start=8, sink_size_end=4, chunk_size=256, sketch_dimension=48
    ),
    "criticalkv": lambda: kvpress.CriticalKVPress(
      kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5), epsilon=1e-4, first_stage_ratio=0.5
    ),
    "chunkkv": lambda: kvpress.ChunkKVPress(
      press=kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5), chunk_length=20
    ),
  }
  if base not in scorers:
    raise SystemExit(f"--presses: unknown press {base!r}; choose from {sorted(scorers)}")
  press = scorers[base]()
  if heads == "adaptive":
    return kvpress.AdaKVPress(press, alpha_safeguard=0.2)
  if heads:
    raise SystemExit(f"--presses: {name!r}: the only suffix is ':adaptive'")
  return press


class FixedSketch:
  """torch, except `randn`, which gives kvjax's Gaussian sketch (kvjax.cache.presses.leverage.sketch
  at seed 0: NumPy's default_rng(0) normals [head_dim, sketch_dimension], the same for every
  layer, head and row) instead of a fresh draw from torch's stream; LeverageScorePress scales it by
  1 / sqrt(sketch_dimension) as kvjax does. Handed to kvpress's leverage module, so that kvpress's
  LeverageScorePress and CompactorPress score with kvjax's sketch and can be compared sample by sample."""

  def __getattr__(self, name):
    return getattr(torch, name)

  @staticmethod
  def randn(*shape, device=None, dtype=None):
    *rows, dim, columns = shape
    drawn = numpy.random.default_rng(0).standard_normal((dim, columns))
    return torch.from_numpy(drawn).to(device=device, dtype=dtype).expand(*rows, dim, columns)


def gguf_tokenizers(gguf: pathlib.Path) -> None:
  """KVzipPress reads its repeat prompt's chat template from AutoTokenizer.from_pretrained(the
  model's name_or_path), which for a model loaded from a GGUF file is its folder: it gets the
  GGUF file's own tokenizer (the one kvjax reads), loaded once."""

  class FromGguf:
    @staticmethod
    @functools.cache
    def from_pretrained(name, **kwargs):
      return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

  kvzip_press.AutoTokenizer = FromGguf


@contextlib.contextmanager
def pressing(press, model):
  """The press applied to `model`'s prefill: kvpress's own context manager, or, for a model with
  sliding-window layers (Gemma 3), its hooks on the global layers only."""
  if press is None:
    yield
    return
  layers = model.model.layers
  if not any(getattr(layer.self_attn, "is_sliding", False) for layer in layers):
    with press(model):
      yield
    return
  press.post_init_from_model(model)
  hooks = []
  try:
    for layer in layers:
      if not layer.self_attn.is_sliding:
        layer.self_attn.rotary_emb = model.model.rotary_emb
        hooks.append(layer.self_attn.register_forward_hook(press.forward_hook, with_kwargs=True))
    yield
  finally:
    for hook in hooks:
      hook.remove()


def greedy(
  model, press, pressed: list[int], after: list[int], new_tokens: int, stop_ids: set[int], ended=None
) -> list[int]:
  """Prefill `pressed` under the press, read `after`, then decode greedily, each token at its
  own position (a pressed cache holds fewer entries than the positions it covers), until a stop
  id, new_tokens, or ended(the tokens so far)."""
  cache = transformers.DynamicCache(config=model.config)
  position = 0

  def feed(ids: list[int]):
    nonlocal position
    positions = torch.arange(position, position + len(ids))[None]
    position += len(ids)
    return model(
      input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
    )

  with torch.inference_mode():
    with pressing(press, model):
      out = feed(pressed)
    if after:
      out = feed(after)
    tokens = []
    for _ in range(new_tokens):
      token = int(out.logits[0, -1].argmax())
      if token in stop_ids:
        break
      tokens.append(token)
      if ended is not None and ended(tokens):
        break
      out = feed([token])
  return tokens


def line_end(gguf: pathlib.Path):
  """The stop test of an answer that ends at its first line (a sample's "answer_end": "line", a
  base model's): its text holds a line break after non-blank text. The answer so stopped is a
  prefix of the budget's, and kvjax cuts both at that line before comparing."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  return lambda ids: "\n" in tokenizer.decode(ids, skip_special_tokens=True).lstrip()


def done(path: pathlib.Path) -> set[tuple]:
  if not path.exists():
    return set()
  keys = set()
  for line in path.read_text().splitlines():
    row = json.loads(line)
    keys.add((row["id"], row["method"], row["protocol"]))
  return keys


def draw(samples: list[dict], n: int, seed: int) -> list[dict]:
  """n samples of each length, drawn without replacement by random.Random(seed) (the module
  docstring's rule), in file order; n=0 keeps them all."""
  if not n:
    return samples
  rng = random.Random(seed)
  by_length: dict[int, list[int]] = {}
  for i, sample in enumerate(samples):
    by_length.setdefault(sample["length"], []).append(i)
  chosen = []
  for length in sorted(by_length):
    group = by_length[length]
    if len(group) < n:
      raise SystemExit(f"--draw {n}: length {length} has only {len(group)} samples")
    chosen += rng.sample(group, n)
  return [samples[i] for i in sorted(chosen)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gguf", required=True, type=pathlib.Path, help="the model's GGUF file (the one kvjax imported)")
  parser.add_argument("--samples", required=True, type=pathlib.Path, help="kvjax's samples.jsonl")
  parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON lines of answers (appended to)")
  parser.add_argument("--presses", default="streaming_llm,snapkv,tova,observed,knorm", help="kvjax press names")
  parser.add_argument("--ratios", default="0.5,0.75", help="compression ratios")
  parser.add_argument("--protocols", default=",".join(PROTOCOLS))
  parser.add_argument("--full", action="store_true", help="also answer with the full cache (method 'full')")
  parser.add_argument("--draw", type=int, default=0, help="N samples per context length, a seeded draw (0: all)")
  parser.add_argument("--seed", type=int, default=0, help="the --draw's seed")
  parser.add_argument("--limit", type=int, default=0, help="only the first N samples (of the draw; 0: all)")
  args = parser.parse_args(argv)
  if not args.gguf.is_file():
    raise SystemExit(f"--gguf {args.gguf}: no such file")
  protocols = args.protocols.split(",")
  if set(protocols) - set(PROTOCOLS):
    raise SystemExit(f"--protocols: choose from {PROTOCOLS}, got {protocols}")
  samples = [json.loads(line) for line in args.samples.read_text().splitlines()]
  samples = draw(samples, args.draw, args.seed)
  if args.limit:
    samples = samples[: args.limit]
  model = transformers.AutoModelForCausalLM.from_pretrained(
    args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32, attn_implementation="sdpa"
  ).eval()
  gguf_tokenizers(args.gguf)
  leverage_press.torch = FixedSketch()
  ends = line_end(args.gguf) if any(s.get("answer_end") == "line" for s in samples) else None
  methods = [("full", None)] if args.full else []
  for ratio in (float(r) for r in args.ratios.split(",")):
    methods += [(f"{name}@{ratio:g}", (name, ratio)) for name in args.presses.split(",")]
  seen = done(args.out)
  meta = {"kvpress_version": importlib.metadata.version("kvpress"), "transformers_version": transformers.__version__}
  with args.out.open("a") as out:
    for method, spec in methods:
      for protocol in protocols if spec is not None else protocols[:1]:
        start = time.perf_counter()
        for sample in samples:
          if (sample["id"], method, protocol) in seen:
            continue
          press = None if spec is None else make_press(*spec)
          # ObservedAttention reads the attention weights, which only eager attention returns;
          # AdaKV refuses eager attention.
          model.set_attn_implementation("eager" if spec and spec[0] == "observed" else "sdpa")
          context, question = sample["context_ids"], sample["question_ids"]
          if protocol == "query_agnostic":
            pressed, after = context, question
          else:
            pressed, after = context + question, []
          began = time.perf_counter()
          stops = set(sample.get("stop_ids", ()))
          ended = ends if sample.get("answer_end") == "line" else None
          ids = greedy(model, press, pressed, after, sample["answer_tokens"], stops, ended)
          seconds = time.perf_counter() - began
          row = {
            "id": sample["id"],
            "method": method,
            "protocol": protocol,
            "answer_ids": ids,
            "seconds": seconds,
            **meta,
          }
          out.write(json.dumps(row) + "\n")
          out.flush()
        print(f"{method} {protocol}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
