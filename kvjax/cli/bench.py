"""`kvjax bench BENCHMARK`: run one of kvjax.bench.benchmarks on the benchmark model (BENCH_MODEL,
changed with --set model.KEY=VALUE) and print its result as JSON. With --model NAME (a named
model, a GGUF file or a Hugging Face directory), `hf`, `perplexity` and `real` run that pretrained model
in kvjax and in transformers side by side (kvjax.bench.real_model, kvjax.bench.real)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvjax.bench import benchmarks, evict, mla, paged, quant, real, real_model
from kvjax.cache.config import CacheConfig
from kvjax.cli import options
from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What --set changes in `kvjax bench`: the benchmark model (model.FIELD) and, for decode, its
  cache (cache.FIELD, kvjax.cache.config.CacheConfig)."""

  model: ModelConfig = benchmarks.BENCH_MODEL
  cache: CacheConfig = CacheConfig()


BENCHMARKS = {
  "decode": benchmarks.bench_decode,
  "nocache": benchmarks.bench_nocache,
  "hf": benchmarks.bench_hf,
  "paged": paged.bench_paged,
  "matmul": benchmarks.bench_matmul,
  "quant": quant.bench_quant,
  "mla": mla.bench_mla,
}


REAL_MODEL_BENCHMARKS = ("evict", "hf", "perplexity", "real")


def _int_list(text: str) -> list[int]:
  """The argparse type of --lengths: comma-separated positive integers."""
  return [options.positive_int(x) for x in text.split(",")]


def _progress(part: str, result: dict) -> None:
  """`real` reports each part as it ends on stderr: a long run's figures survive an interruption."""
  print(f"kvjax bench real: {part} done: {json.dumps(result)}", file=sys.stderr, flush=True)


def _parts(text: str) -> list[str]:
  """The argparse type of --parts: comma-separated names of kvjax.bench.real.PARTS."""
  parts = [p.strip() for p in text.split(",") if p.strip()]
  unknown = sorted(set(parts) - set(real.PARTS))
  if not parts or unknown:
    raise argparse.ArgumentTypeError(f"must name parts of {','.join(real.PARTS)}, got {text!r}")
  return parts


def check_lengths(model: ModelConfig, args: argparse.Namespace) -> None:
  """Refuses, before the benchmark model is built, generations longer than the model's context."""
  new = {"decode": args.new, "hf": args.new, "nocache": max(args.lengths)}.get(args.benchmark)
  if new is not None:
    model.check_length(
      args.prompt + new - 1, f"--prompt {args.prompt} + {new} new tokens need {args.prompt + new - 1} cache positions"
    )


def benchmark_kwargs(args: argparse.Namespace) -> dict:
  """The keyword arguments of BENCHMARKS[args.benchmark] taken from the command line."""
  timing = {"repeats": args.repeats} if args.batch is None else {"batch": args.batch, "repeats": args.repeats}
  generation = {**timing, "prompt": args.prompt, "new_tokens": args.new}
  return {
    "decode": generation,
    "nocache": {
      "prompt": args.prompt,
      "new_token_counts": args.lengths,
      "concat_max": args.concat_max,
      "repeats": args.repeats,
    },
    "hf": {**generation, "threads": args.threads},
    "paged": {**timing, "context": args.context, "page_size": args.page_size},
    "matmul": timing,
    "quant": {**timing, "context": args.context},
    "mla": {**timing, "context": args.context, "rope_dims": args.rope_dims},
  }[args.benchmark]


def real_model_result(args: argparse.Namespace) -> dict:
  """`hf` or `perplexity` on the pretrained model args.model."""
  if args.overrides:
    raise ValueError("--set changes the benchmark model; with --model the pretrained model is used as it is")
  if args.benchmark == "evict":
    return evict.bench_evict(args.model, batch=args.batch or 8, context=args.context, repeats=args.repeats)
  if args.benchmark == "real":
    return real.bench_real(args.model, parts=args.parts, repeats=min(args.repeats, 3), progress=_progress)
  if args.benchmark == "perplexity":
    return real_model.bench_perplexity(
      args.model, seq_len=args.seq_len, batch=args.batch or 4, batches=args.windows_batches
    )
  batches = (args.batch,) if args.batch else (1, 8)
  return real_model.bench_decode(
    args.model, batches=batches, prompt=args.prompt, new_tokens=args.new, repeats=args.repeats
  )


def command(args: argparse.Namespace) -> int:
  needs_model = sorted(set(REAL_MODEL_BENCHMARKS) - set(BENCHMARKS))
  if args.model is not None or args.benchmark in needs_model:
    if args.model is None or args.benchmark not in REAL_MODEL_BENCHMARKS:
      raise ValueError(
        f"--model runs {', '.join(REAL_MODEL_BENCHMARKS)} only, and {', '.join(needs_model)} need --model"
      )
    print(json.dumps(real_model_result(args), indent=None if args.json else 2))
    return 0
  config = options.apply_set(BenchConfig(), args)
  check_lengths(config.model, args)
  kwargs = benchmark_kwargs(args)
  if config.cache != CacheConfig():
    if args.benchmark != "decode":
      raise ValueError(f"--set cache.* applies to the decode benchmark; {args.benchmark} sets its own caches")
    kwargs["cache_config"] = config.cache
  result = BENCHMARKS[args.benchmark](config.model, **kwargs)
  print(json.dumps(result, indent=None if args.json else 2))
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
    "bench",
    help="decoding benchmarks (JSON)",
    description=benchmarks.__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("benchmark", choices=sorted({*BENCHMARKS, *REAL_MODEL_BENCHMARKS}))
  parser.add_argument(
    "--model",
    type=options.path_text,
    help="hf, perplexity: a pretrained model (named, e.g. smollm2-135m; a .gguf; a Hugging Face "
    "folder) run in kvjax and transformers",
  )
  parser.add_argument("--seq-len", type=options.positive_int, default=1024, help="perplexity: tokens per window")
  parser.add_argument(
    "--windows-batches",
    type=options.positive_int,
    default=3,
    help="perplexity: batches of --batch windows (default batch 4)",
  )
  options.add_set_option(parser)
  parser.add_argument(
    "--batch", type=options.positive_int, default=None, help="sequences (rows) per step (default: 8; quant: 32)"
  )
  parser.add_argument("--prompt", type=options.positive_int, default=128, help="prompt tokens per sequence")
  parser.add_argument("--new", type=options.positive_int, default=128, help="new tokens per sequence")
  parser.add_argument("--repeats", type=options.positive_int, default=5, help="timed runs after warm-up (median)")
  parser.add_argument(
    "--lengths", type=_int_list, default=[64, 128, 256, 512], help="nocache: comma-separated numbers of new tokens"
  )
  parser.add_argument(
    "--concat-max",
    type=options.nonnegative_int,
    default=64,
    help="nocache: longest run for the concat cache (it compiles once per length)",
  )
  parser.add_argument("--threads", type=options.nonnegative_int, default=0, help="hf: torch threads (default: torch's)")
  parser.add_argument(
    "--context", type=options.positive_int, default=1024, help="paged, quant, mla: tokens cached per row"
  )
  parser.add_argument("--page-size", type=options.positive_int, default=16, help="paged: tokens per page")
  parser.add_argument(
    "--rope-dims", type=options.nonnegative_int, help="mla: rotary dims of the MLA model (default 16 per kv head)"
  )
  parser.add_argument(
    "--parts",
    type=_parts,
    default=list(real.PARTS),
    help=f"real: comma-separated parts to run, of {','.join(real.PARTS)} (default: all)",
  )
  parser.add_argument("--json", action="store_true", help="one line of JSON")
  parser.set_defaults(func=command)
