"""The tasks of a RULER-style long-context suite (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"), generated offline for one tokenizer.

Each task follows RULER's synthetic/*.py definition and its published prompt templates:
  niah_single_1      one needle (a word key, a 7-digit value) in the noise haystack: RULER's
                     five sentences "The grass is green. ..." repeated, one per line;
  niah_single_2/3    one needle in prose (Python's own documentation for RULER's essays), a
                     number / a uuid-like value;
  niah_multikey_1    four needles in prose, one asked for (three distractors);
  niah_multikey_2/3  the haystack itself is needles (distractors) with word / uuid keys;
  niah_multivalue    one key with four values, all expected;
  niah_multiquery    four keys asked for at once, every value expected;
  vt                 variable tracking: a chain of 4 hops "VAR B = VAR A" in the noise haystack,
                     after one worked example; every variable of the chain expected;
  cwe                common words extraction: a numbered word list, 10 words repeated more often
                     than the rest, after one worked example;
  fwe                frequent words extraction: coded words drawn from a Zipf law (alpha 2), the
                     three most frequent after the top one ("...") expected.
Words come from a generator seeded by (seed, task, length, index) over the lowercase words of
Python's documentation (no word list is downloaded); uuid-like values are random 128-bit uuid4s.

A sample's prompt is exactly `length` token ids, built as passkey.py builds its prompts: the
parts are encoded one by one and their ids joined. context_ids (the template's opening, the
haystack with its needles) + question_ids (the question, the chat template's end of the user
turn and start of the reply, RULER's answer prefix) = `length`. The haystack takes what the rest
leaves: whole units (noise lines, prose sentences, distractor needles) then the ids of one more
cut to fit, as RULER cuts its essay at a word count; needles sit between whole units at depths
drawn at random. Nothing here runs a model.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies.suite.ruler_prompts import (
  CWE,
  FWE,
  NEEDLE,
  NIAH,
  NOISE,
  VT,
  Frame,
  distinct,
  fill,
  prose_of,
  prose_units,
  repeated,
  resolve_template,
  sample,
  split,
  too_short,
  words,
)


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: its kind ("niah", "vt", "cwe", "fwe"), and for a needle task its haystack
  ("noise", "prose" or "needle": distractor needles), key and value types ("numbers", "words",
  "uuids"), keys planted, values per key, keys asked for."""

  kind: str
  haystack: str = ""
  key_type: str = "words"
  value_type: str = "numbers"
  keys: int = 1
  values: int = 1
  queries: int = 1


# RULER's synthetic.yaml, its essays replaced by Python's prose.
TASKS = {
  "niah_single_1": Task("niah", "noise"),
  "niah_single_2": Task("niah", "prose"),
  "niah_single_3": Task("niah", "prose", value_type="uuids"),
  "niah_multikey_1": Task("niah", "prose", keys=4),
  "niah_multikey_2": Task("niah", "needle"),
  "niah_multikey_3": Task("niah", "needle", key_type="uuids", value_type="uuids"),
  "niah_multivalue": Task("niah", "prose", values=4),
  "niah_multiquery": Task("niah", "prose", keys=4, queries=4),
  "vt": Task("vt", "noise"),
  "cwe": Task("cwe"),
  "fwe": Task("fwe"),
}


def check_tasks(tasks) -> tuple[str, ...]:
  """The task names as a tuple; ValueError naming any that is not one of TASKS."""
  tasks = tuple(tasks)
  for name in tasks:
    if name not in TASKS:
      raise ValueError(f"unknown RULER task {name!r}: choose among {', '.join(TASKS)}")
  if not tasks:
    raise ValueError(f"no RULER task given: choose among {', '.join(TASKS)}")
  return tasks


def niah(tokenizer, task: Task, name: str, length: int, template: str, rng) -> dict:
  keys = distinct(task.key_type, max(task.keys, task.queries), rng)
  drawn = distinct(task.value_type, len(keys) * task.values, rng, keys)
  values = [drawn[i * task.values : (i + 1) * task.values] for i in range(len(keys))]
  kind = task.value_type
  needles = [NEEDLE.format(type_needle_v=kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
  order = rng.permutation(len(needles))
  asked = sorted(rng.choice(len(keys), task.queries, replace=False))
  references = [v for i in asked for v in values[i]]
  query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]] if len(asked) > 1 else keys[asked[0]]
  text, prefix, _ = NIAH
  if task.queries * task.values == 1:  # RULER's wording for one answer
    text = text.replace("Some", "A").replace("are all", "is").replace("are", "is")
    prefix = prefix.replace("are", "is")
    kind = kind[:-1]
  head, question = split(text.format(type_needle_v=kind, query=query, context="{context}"))
  frame = Frame.of(tokenizer, template, head, question, prefix.format(type_needle_v=kind, query=query))
  sep = "\n" if task.haystack != "prose" else " "
  pieces = [tokenizer.encode(sep + needles[i]) for i in order]
  if task.haystack == "noise":
    units = repeated(tokenizer.encode(NOISE), tokenizer.encode(sep + NOISE))
  elif task.haystack == "prose":
    units = prose_units(prose_of(tokenizer), rng)
  else:
    units = distractors(tokenizer, task, set(keys), set(references), rng)
  fixed = len(frame.head) + len(frame.tail)
  context, offsets = fill(units, pieces, length - fixed, rng, lambda n: too_short(name, length, fixed + n))
  first = min(offsets[j] for j, i in enumerate(order) if needles[i].endswith(f" {references[0]}."))
  return sample(frame, context, references, first)


def distractors(tokenizer, task: Task, keys: set, references: set, rng):
  """Needle sentences of fresh keys and values (the needle haystack), none a key or a reference."""
  kind = task.value_type
  sep = ""  # the first needle starts the context's line
  while True:
    (k,) = distinct(task.key_type, 1, rng, keys)
    (v,) = distinct(kind, 1, rng, references)
    yield tokenizer.encode(sep + NEEDLE.format(type_needle_v=kind, key=k, value=v))
    sep = "\n"


def chain(rng, hops: int = 4) -> tuple[list[str], str, list[str]]:
  """RULER's variable chain: hops + 1 distinct names of 5 capitals, a 5-digit value -> (the
  assignment lines, the value, the names)."""
  names: list[str] = []
  while len(names) < hops + 1:
    name = "".join(chr(ord("A") + int(c)) for c in rng.integers(26, size=5))
    if name not in names:
      names.append(name)
  number = str(int(rng.integers(10000, 99999)))
  lines = [f"VAR {names[0]} = {number}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
  return lines, number, names


def vt(tokenizer, name: str, length: int, template: str, rng) -> dict:
  text, prefix, _ = VT
  lines, number, names = chain(rng)
  # One worked example first, as RULER's few-shot default does: a chain in five noise lines.
  shown, shown_number, shown_names = chain(rng)
  noise = [NOISE] * 5
  for j, (i, line) in enumerate(zip(sorted(rng.choice(5, len(shown), replace=True)), shown)):
    noise.insert(i + j, line)  # the chain's lines keep their order
  example = text.format(context="\n".join(noise), query=shown_number)
  example += prefix.format(num_v=len(shown_names), query=shown_number) + " ".join(shown_names)
  head, question = split(text.format(query=number, context="{context}"))
  frame = Frame.of(
    tokenizer, template, example + "\n\n" + head, question, prefix.format(num_v=len(names), query=number)
  )
  pieces = [tokenizer.encode("\n" + line) for line in lines]
  units = repeated(tokenizer.encode(NOISE), tokenizer.encode("\n" + NOISE))
  fixed = len(frame.head) + len(frame.tail)
  context, offsets = fill(units, pieces, length - fixed, rng, lambda n: too_short(name, length, fixed + n))
  return sample(frame, context, names, offsets[0])


def numbered(entries: list[str], start: int = 1) -> str:
  return " ".join(f"{i}. {w}" for i, w in enumerate(entries, start))


def cwe(tokenizer, name: str, length: int, template: str, rng) -> dict:
  text, prefix, _ = CWE
  repeats, once = (6, 1) if length < 4096 else (30, 3)  # RULER's counts below and above 4K
  pool = words()
  shown = [pool[i] for i in rng.choice(len(pool), 20, replace=False)]
  listed = shown[:10] * 3 + shown[10:]
  example = text.format(context=numbered([listed[i] for i in rng.permutation(len(listed))]))
  example += prefix + " " + numbered(shown[:10])
  head, question = split(text)
  frame = Frame.of(tokenizer, template, example + "\n" + head, question, prefix)
  budget = length - len(frame.head) - len(frame.tail)
  drawn = [pool[i] for i in rng.permutation(len(pool))]
  common, rest = drawn[:10], drawn[10:]
  uncommon = budget // 4
  while True:  # the common words and as many others as fit, shuffled, then others cut to fit
    entries = common * repeats + rest[:uncommon] * once
    entries = [entries[i] for i in rng.permutation(len(entries))]
    ids = tokenizer.encode(numbered(entries))
    if len(ids) <= budget:
      break
    if uncommon == 0:
      raise too_short(name, length, length - budget + len(ids))
    uncommon = max(0, uncommon - max(1, (len(ids) - budget) // 6))
  spare = rest[uncommon:]
  while len(ids) < budget:
    more = tokenizer.encode(" " + numbered(spare[:64], len(entries) + 1))
    ids = np.concatenate([ids, more])
    entries, spare = entries + spare[:64], spare[64:]
  return sample(frame, ids[:budget], common)


def fwe(tokenizer, name: str, length: int, template: str, rng, alpha: float = 2.0) -> dict:
  text, prefix, tokens = FWE
  head, question = split(text)
  frame = Frame.of(tokenizer, template, head, question, prefix)
  budget = length - len(frame.head) - len(frame.tail)
  size = max(20, (length - tokens) // 50)  # RULER's vocabulary: a coded word per 50 tokens
  vocab: list[str] = []
  while len(vocab) < size:
    word = "".join(chr(ord("a") + int(c)) for c in rng.integers(26, size=6))
    if word not in vocab:
      vocab.append(word)
  vocab[0] = "..."  # the most frequent word is noise, as in RULER
  zeta = math.pi**2 / 6 if alpha == 2.0 else sum(k**-alpha for k in range(1, 100000))
  ranks = np.arange(1, size + 1) ** -alpha / zeta

  def coded(count: int) -> np.ndarray:
    drawn = [w for w, c in zip(vocab, (count * ranks).astype(int)) for _ in range(c)]
    return tokenizer.encode(" ".join(drawn[i] for i in rng.permutation(len(drawn))))

  count = budget
  ids = coded(count)
  while len(ids) > budget and count > 0:
    count -= max(1, (len(ids) - budget) // 3)
    ids = coded(count)
  if count < 16:
    raise too_short(name, length, length - budget + 64)
  dots = tokenizer.encode(" ...")  # padded to the exact length with the noise word
  pad = np.tile(dots, -(-(budget - len(ids)) // len(dots)))[: budget - len(ids)]
  return sample(frame, np.concatenate([ids, pad]).astype(np.int32), vocab[1:4])


def answer_budget(tokenizer: TextTokenizer, task: str, references: list[str]) -> int:
  """RULER's tokens_to_generate for the task, or twice the tokens of the expected answer if more."""
  kind = TASKS[task].kind
  tokens = {"niah": NIAH, "vt": VT, "cwe": CWE, "fwe": FWE}[kind][2]
  return max(tokens, 2 * len(tokenizer.encode(" " + ", ".join(references))))


def make_sample(
  tokenizer: TextTokenizer, task: str, length: int, index: int, *, seed: int = 0, template: str = "auto"
) -> dict:
  """One sample (the shared format: id, task, length, context_ids, question_ids, references,
  answer_tokens, and depth / distance for a needle task), the same for every (seed, task, length,
  index) and tokenizer."""
  check_tasks([task])
  template = resolve_template(tokenizer, template)
  rng = np.random.default_rng([seed, list(TASKS).index(task), length, index])
  spec = TASKS[task]
  if spec.kind == "niah":
    body = niah(tokenizer, spec, task, length, template, rng)
  else:
    body = {"vt": vt, "cwe": cwe, "fwe": fwe}[spec.kind](tokenizer, task, length, template, rng)
  return {
    "id": f"{task}/{length}/{index}",
    "task": task,
    "length": length,
    **body,
    "answer_tokens": answer_budget(tokenizer, task, body["references"]),
  }
