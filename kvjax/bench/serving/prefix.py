"""`kvjax bench prefix --model smollm2-135m`: what the engine's prefix cache saves. One document of
--document tokens (stdlib prose) in the chat template, then --questions requests, each the
document and a different question, sent one after another to an idle engine: the time from submit
to the first token of the first (which computes the document) and of each later one (which reads
the document's pages), with the prefix cache on and, as the control, off; the tokens each prefill
computed; and whether every answer equals the one made without the cache (greedy).
"""

from __future__ import annotations

import time

import numpy as np

from kvjax.bench.base.registry import PRETRAINED_MODEL, Benchmark, Option
from kvjax.cache.config import CacheConfig
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, load_dataset

QUESTIONS = (
  "Summarise the text above in one sentence.",
  "What is the main subject of the text above?",
  "List three words that appear in the text above.",
  "Is the text above about programming?",
)


def prompts(tokenizer, document_tokens: int, questions: int) -> list[np.ndarray]:
  text = load_dataset(DataConfig(source=PROSE, seq_len=document_tokens), tokenizer).val
  document = tokenizer.decode([int(t) for t in np.asarray(text[:document_tokens])])
  out = []
  for i in range(questions):
    message = f"{document}\n\n{QUESTIONS[i % len(QUESTIONS)]}"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    out.append(np.asarray(tokenizer.encode(chat), np.int32))
  return out


def first_tokens(engine: Engine, prompts: list[np.ndarray], new_tokens: int) -> dict:
  """Each prompt alone in the engine: seconds from submit to its first token, its answer, and the
  context tokens its prefill computed."""
  seconds, answers, computed = [], [], []
  for prompt in prompts:
    before = engine.stats.prompt_tokens - engine.stats.cached_tokens
    start = time.perf_counter()
    rid = engine.submit(prompt, new_tokens)
    while not _answered(engine, rid):  # its prefill, in chunks of prefill_chunk tokens, and its first token
      engine.step()
    seconds.append(time.perf_counter() - start)
    computed.append(engine.stats.prompt_tokens - engine.stats.cached_tokens - before)
    answers.append(engine.run()[rid].tolist())
    engine.finished.clear()
  return {"first_token_s": seconds, "answers": answers, "computed_tokens": computed}


def _answered(engine: Engine, request_id: int) -> bool:
  """Whether the request has its first token (it may have finished with it)."""
  if request_id in engine.finished:
    return True
  return any(r.id == request_id and r.generated for r in engine.running)


def run(*, model: str, document: int, questions: int, new_tokens: int) -> dict:
  params, config, tokenizer, _ = read_model(model)
  if tokenizer is None:
    raise ValueError(f"{model} has no tokenizer; the benchmark builds chat prompts")
  asks = prompts(tokenizer, document, questions)
  longest = max(p.size for p in asks) + new_tokens
  max_len = -(-longest // 16) * 16
  out = {"benchmark": "prefix", "model": model, "prompt_tokens": [int(p.size) for p in asks]}
  sides = {}
  for caching in (True, False):
    engine_config = EngineConfig(
      num_slots=1,
      num_pages=2 * max_len // 16 + 1,
      max_len=max_len,
      cache=CacheConfig(layout="paged", page_size=16),
      stop_ids=tuple(tokenizer.stop_ids),
      prefix_caching=caching,
    )
    engine = Engine(Transformer(config), params, engine_config)
    engine.warmup()
    sides[caching] = first_tokens(engine, asks, new_tokens)
  on, off = sides[True], sides[False]
  later_on = float(np.median(on["first_token_s"][1:]))
  out.update(
    {
      "cache_on": {k: v for k, v in on.items() if k != "answers"},
      "cache_off": {k: v for k, v in off.items() if k != "answers"},
      "first_over_later_on": on["first_token_s"][0] / later_on,
      "later_off_over_later_on": float(np.median(off["first_token_s"][1:])) / later_on,
      "same_answers": on["answers"] == off["answers"],
    }
  )
  return out


BENCHMARK = Benchmark(
  name="prefix",
  summary="the engine's prefix cache: time to the first token of requests over one shared document",
  description=__doc__,
  run=run,
  options=(
    PRETRAINED_MODEL,
    Option("document", 2048, "tokens of the shared document"),
    Option("questions", 4, "requests over it, one after another"),
    Option("new_tokens", 16, "tokens each answer makes"),
  ),
)
