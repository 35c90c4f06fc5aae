"""Where one sample of the presses table spends its time (kvjax.studies.press_table): the sample's
cells answered together (kvjax.studies.suite.ruler_answers.answer_cells), twice (the first run compiles), with
the seconds of the shared prefill, the stacking of caches, the question's extend and the decode
steps by batch size, as JSON lines.

  python experiments/press_table_sample.py --source gemma3-270m --id niah_single_3/1024/3 \
      --ratios 0.5,0.75 --protocol query_agnostic

The cells are those of configs/press_table/cpu.py at the given ratios, less the ones the model
refuses. Timing wraps the module functions that answer_cells calls (kvjax.decoding.many reads them
from their modules at call time) and blocks on each result.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from kvjax.cache.layouts import stack
from kvjax.cli.run import load_config
from kvjax.decoding import decode, many
from kvjax.studies import press_table
from kvjax.studies.suite import ruler_answers


def timed(totals: dict, key: str, function):
  def call(*args, **kwargs):
    start = time.perf_counter()
    out = jax.block_until_ready(function(*args, **kwargs))
    name = f"{key} at batch {args[2].lengths.shape[0]}" if key == "decode step" else key
    count, seconds = totals.get(name, (0, 0.0))
    totals[name] = (count + 1, seconds + time.perf_counter() - start)
    return out

  return call


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--source", default="gemma3-270m")
  parser.add_argument("--id", default="niah_single_3/1024/3", help="a sample id, TASK/LENGTH/INDEX")
  parser.add_argument("--ratios", default="0.5,0.75")
  parser.add_argument("--protocol", default="query_agnostic", choices=("query_agnostic", "query_aware"))
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  length = int(args.id.split("/")[1])
  ratios = tuple(float(r) for r in args.ratios.split(","))
  study = load_config("configs/press_table/cpu.py")
  study = press_table.PressTableStudy(
    sources=(args.source,), lengths=(length,), ratios=ratios, protocols=(args.protocol,), codec_cells=study.codec_cells
  )
  model, params, tokenizer, _ = ruler_answers.load(args.source)
  samples = ruler_answers.build(
    tokenizer, study.tasks, (length,), study.samples, seed=0, max_len=model.config.max_positions
  )
  sample = next(s for s in samples if s["id"] == args.id)
  configs = [  # refused as the study refuses them: KVzip with the tokenizer's repeat prompt
    c
    for _, p, c in press_table.cells(study)
    if p == args.protocol and press_table.refusal(model, c.bind(tokenizer), length) is None
  ]
  totals: dict = {}
  many.prefill_many = timed(totals, "prefill_many", many.prefill_many)
  decode.decode_step = timed(totals, "decode step", decode.decode_step)
  decode.extend = timed(totals, "extend", decode.extend)
  stack.stack = timed(totals, "stack", stack.stack)
  stack.take = timed(totals, "take", stack.take)
  for repeat in range(args.repeats):
    totals.clear()
    start = time.perf_counter()
    ruler_answers.answer_cells(model, params, tokenizer, sample, configs, protocol=args.protocol)
    seconds = time.perf_counter() - start
    parts = {k: {"calls": n, "seconds": round(s, 2)} for k, (n, s) in sorted(totals.items())}
    print(json.dumps({"repeat": repeat, "caches": len(configs), "seconds": round(seconds, 2), "parts": parts}))


if __name__ == "__main__":
  main()
