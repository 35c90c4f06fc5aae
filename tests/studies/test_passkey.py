"""The pass-key test: its samples (exact lengths, the needle at a random depth, distance and
depth recorded, chat and plain frames, seeded), its answer budget against a model built by hand
to answer "The secret passkey is 48213.", its scoring, its paged answers against the contiguous
cache, and its refusals."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import numpy as np
import pytest

from kvjax.cache.config import CacheConfig
from kvjax.cli.main import main as kvjax_main
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies.base import measure
from kvjax.studies.suite.passkey import (
  PARAGRAPH,
  SEPARATOR,
  WORDINGS,
  Frame,
  PasskeyConfig,
  Prose,
  answer_budget,
  judge,
  prose_sentences,
  samples,
)
from kvjax.studies.suite.passkey_run import all_samples, passkey
from kvjax.studies.base.scoring import read_jsonl
from kvjax.training.checkpoint import save_params
from kvjax.training.data import documentation
from conftest import init_params, tiny_config

tokenizers = pytest.importorskip("tokenizers", reason="needs the tokenizers package")

CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_OPENING, CHAT_CLOSING = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
SPECIAL = ("<unk>", "<s>", "<|im_start|>", "<|im_end|>")
KEY = "48213"


@functools.cache
def word_tokenizer(chat: bool) -> TextTokenizer:
  """A word-level tokenizer over the held-out documentation and the prompts' own words: a word
  with the space before it, a digit, any other character, each one token; decode joins them
  back into the text. With a chat template (ChatML) or without one (then a bos starts a prompt)."""
  split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r" ?[A-Za-z]+| ?[0-9]|\s|[^\sA-Za-z0-9]"), "isolated")
  sentences = [(before + sentence, sentence) for before, sentence in prose_sentences(documentation()[1].decode())]
  words = [
    text.format(key="0123456789 " + " ".join("0123456789")) for w in WORDINGS.values() for text in vars(w).values()
  ]
  texts = (*(text for pair in sentences for text in pair), *words, SEPARATOR + PARAGRAPH, "user\nassistant")
  pieces = sorted({piece for text in texts for piece, _ in split.pre_tokenize_str(text)})
  vocab = {token: i for i, token in enumerate((*SPECIAL, *pieces))}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer, tokenizer.decoder = split, tokenizers.decoders.Fuse()
  tokenizer.add_special_tokens(list(SPECIAL))
  if chat:
    return TextTokenizer(tokenizer, eos_id=vocab["<|im_end|>"], unk_id=0, chat_template=CHAT_TEMPLATE)
  return TextTokenizer(tokenizer, bos_id=vocab["<s>"], eos_id=vocab["<|im_end|>"], unk_id=0, add_bos=True)


def tiny_llama(tokenizer: TextTokenizer, max_len: int):
  """A random Llama-family model (RMSNorm, SwiGLU, RoPE, GQA) over the tokenizer's vocabulary."""
  return init_params(
    tiny_config(vocab_size=tokenizer.vocab_size, max_len=max_len, activation="swiglu", norm="rmsnorm", positions="rope")
  )


def answering(tokenizer: TextTokenizer, answer: str, max_len: int = 1024):
  """A one-layer Llama-family model whose weights are set by hand so that after any prompt (whose
  last token is not one of the answer's) it answers `answer` greedily, then stops.

  Attention and MLP write nothing (their output kernels are zero), so the last position's logits
  are lm_head(norm(embedding)): a next-token map. Every token is embedded on direction 0, but the
  answer's i-th token on direction i + 1; lm_head sends direction 0 to the answer's first token,
  direction i + 1 to its (i + 1)-th, and the last to the tokenizer's eos."""
  chain = tokenizer.encode(answer).tolist()
  assert len(set(chain)) == len(chain), "a next-token map needs an answer without repeated tokens"
  width = len(chain) + 1
  model, params = init_params(
    tiny_config(
      vocab_size=tokenizer.vocab_size,
      d_model=width,
      num_layers=1,
      num_heads=1,
      num_kv_heads=1,
      head_dim=4,
      mlp_dim=4,
      max_len=max_len,
      activation="swiglu",
      norm="rmsnorm",
      positions="rope",
      tie_embeddings=False,
    )
  )
  embedding = np.zeros((tokenizer.vocab_size, width), np.float32)
  embedding[:, 0] = 1.0
  head = np.zeros((width, tokenizer.vocab_size), np.float32)
  for i, (token, following) in enumerate(zip(chain, chain[1:] + [tokenizer.eos_id])):
    embedding[token] = np.eye(width)[i + 1]
    head[i + 1, following] = 1.0
  head[0, chain[0]] = 1.0
  layer = params["layers_0"]
  params = {
    **params,
    "embed": {"embedding": embedding},
    "lm_head": {"kernel": head},
    "layers_0": {
      **layer,
      "attn": {**layer["attn"], "out": {"kernel": np.zeros_like(layer["attn"]["out"]["kernel"])}},
      "mlp": {**layer["mlp"], "down": {"kernel": np.zeros_like(layer["mlp"]["down"]["kernel"])}},
    },
  }
  return model, params


def sentences_of(text: str) -> list[str]:
  return [s for paragraph in text.split(PARAGRAPH) for s in re.split(r"(?<=[.!?]) (?=[A-Z])", paragraph)]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
@pytest.mark.parametrize("wording", ["secret", "landmark"])
def test_a_sample_is_exactly_length_tokens_with_the_needle_at_its_depth(chat, wording):
  tokenizer, length = word_tokenizer(chat), 150
  config = PasskeyConfig(lengths=(length,), needles=4, seed=3, wording=wording)
  words, frame = WORDINGS[wording], Frame.of(tokenizer, WORDINGS[wording])
  found = samples(tokenizer, config, length, Prose.of(tokenizer))
  whole = {sentence for _, sentence in prose_sentences(documentation()[1].decode())}
  assert [s["id"] for s in found] == [f"passkey/150/{i}" for i in range(4)] and len(
    {s["references"][0] for s in found}
  ) == 4
  for s in found:
    key, ids = s["references"][0], np.array(s["context_ids"] + s["question_ids"])
    assert s["task"] == "passkey" and s["length"] == length == len(ids) and s["question_ids"] == frame.closing.tolist()
    needle = tokenizer.encode(words.needle.format(key=key))
    start = length - s["distance"]
    assert len(key) == 5 and (ids[start : start + len(needle)] == needle).all()
    # The depth: the needle's start over the haystack (the tokens between the frame's pieces).
    haystack = length - len(frame.opening) - len(frame.separator) - len(needle) - 1 - len(frame.closing)
    assert s["depth"] == pytest.approx((start - len(frame.opening) - len(frame.separator)) / haystack)
    # Twice the answer sentence: "The secret passkey is 4 8 2 1 3." is 10 word-level tokens.
    assert s["answer_tokens"] == 2 * len(tokenizer.encode(words.answer.format(key=key)))
    text = tokenizer.decode(ids)
    if chat:
      head, tail = CHAT_OPENING + words.instruction + SEPARATOR, SEPARATOR + words.question + CHAT_CLOSING
    else:
      assert ids[0] == tokenizer.bos_id and "<|im_start|>" not in text
      head, tail = "<s>" + words.instruction + SEPARATOR, f"{SEPARATOR}{words.question} {words.prefix}"
    assert text.startswith(head) and text.endswith(tail) and "<unk>" not in text
    lead, filler = text[len(head) : -len(tail)].split(SEPARATOR + words.needle.format(key=key) + SEPARATOR)
    assert set(sentences_of(lead)) | set(sentences_of(filler)) - {""} <= whole | {""}  # whole sentences of the prose
  assert samples(tokenizer, config, length, Prose.of(tokenizer)) == found  # seeded
  assert samples(tokenizer, dataclasses.replace(config, seed=4), length, Prose.of(tokenizer)) != found


def test_the_needle_depths_spread_over_the_haystack():
  tokenizer = word_tokenizer(True)
  found = samples(tokenizer, PasskeyConfig(lengths=(400,), needles=40), 400, Prose.of(tokenizer))
  depths = np.array([s["depth"] for s in found])
  # Uniform draws: every quarter of the haystack holds needles; the distance falls as the depth grows.
  assert ((0 <= depths) & (depths <= 1)).all() and len(set(np.floor(depths * 4).clip(0, 3))) == 4
  order = np.argsort(depths)
  assert (np.diff([found[i]["distance"] for i in order]) <= 0).all()


def test_the_budget_holds_the_answer_that_ten_tokens_cut(smollm2):
  """SmolLM2's tokenizer spends a token per digit: "The secret passkey is 48213." is 12 tokens
  (The | secret | pass | key | is | ' ' | 4 | 8 | 2 | 1 | 3 | .), so an answer of 10 ends "4821"."""
  tokenizer = TextTokenizer.load(smollm2)
  model, params = answering(tokenizer, f"The secret passkey is {KEY}.", max_len=128)
  prompt = tokenizer.encode(
    tokenizer.apply_chat_template(
      [{"role": "user", "content": "What is the secret passkey?"}], add_generation_prompt=True
    )
  )
  budget = answer_budget(tokenizer, PasskeyConfig(), KEY)
  assert budget == 24
  sample = {
    "id": "passkey/0/0",
    "task": "passkey",
    "length": len(prompt),
    "references": [KEY],
    "depth": 0.5,
    "distance": 9,
  }
  scores = {}
  for tokens in (10, budget):
    _, [result] = measure.recall(
      model,
      params,
      prompt[None],
      np.array([len(prompt)]),
      [{**sample, "answer_tokens": tokens}],
      judge(tokenizer),
      tokens,
      stop_ids=tokenizer.stop_ids,
    )
    scores[tokens] = (result["answer"], result["score"])
  assert scores == {10: ("The secret passkey is 4821", 0.0), 24: ("The secret passkey is 48213.", 1.0)}
  with pytest.raises(ValueError, match=r"PasskeyConfig.answer_tokens=10 cannot hold .*\(24 tokens"):
    answer_budget(tokenizer, PasskeyConfig(answer_tokens=10), KEY)
  assert answer_budget(tokenizer, PasskeyConfig(answer_tokens=30), KEY) == 30


def test_recall_counts_the_samples_whose_answer_holds_the_key():
  """The hand-built model answers 48213 to every prompt: samples whose key is 48213 (made so by
  hand: the 1st and 3rd of 3) are hits, the rest are not, per length, in batches of 2."""
  tokenizer = word_tokenizer(True)
  model, params = answering(tokenizer, f"The secret passkey is {KEY}.", max_len=256)
  config = PasskeyConfig(lengths=(100, 120), needles=3, batch_size=2)
  inputs = all_samples(tokenizer, config)
  inputs = [{**s, "references": [KEY]} if s["id"].endswith(("/0", "/2")) else s for s in inputs]
  found = passkey(model, params, tokenizer, config, inputs=inputs, method="hand-built")
  assert [found[n]["recall"] for n in ("100", "120")] == [2 / 3, 2 / 3]
  for n, result in found.items():
    assert [r["hit"] for r in result["samples"]] == [True, False, True]
    assert [r["id"] for r in result["samples"]] == [f"passkey/{n}/{i}" for i in range(3)]
    assert {r["answer"] for r in result["samples"]} == {f"The secret passkey is {KEY}."}
    assert all(r["method"] == "hand-built" and r["length"] == int(n) for r in result["samples"])


def test_paged_answers_in_batches_equal_the_contiguous_cache():
  tokenizer = word_tokenizer(True)
  model, params = tiny_llama(tokenizer, max_len=160)
  config = PasskeyConfig(lengths=(100, 110), needles=2, batch_size=2)
  contiguous = passkey(model, params, tokenizer, config)
  paged = dataclasses.replace(config, batch_size=1)  # and one example at a time
  assert passkey(model, params, tokenizer, paged, cache_config=CacheConfig(layout="paged")) == contiguous
  assert list(contiguous) == ["100", "110"]
  for result in contiguous.values():
    assert [s["index"] for s in result["samples"]] == [0, 1] and result["needles"] == 2
  assert any(s["answer"] for r in contiguous.values() for s in r["samples"])  # tokens, not an immediate stop


def test_too_short_a_length_or_model_is_refused():
  tokenizer = word_tokenizer(True)
  prose = Prose.of(tokenizer)
  with pytest.raises(ValueError, match=r"lengths: 40 tokens cannot hold the instruction, the needle sentence"):
    samples(tokenizer, PasskeyConfig(lengths=(40,)), 40, prose)
  assert Prose.of(tokenizer, "Ab cd ef gh. Ij kl mn.").run(3, np.random.default_rng(0)) is None
  model, params = tiny_llama(tokenizer, max_len=128)
  with pytest.raises(ValueError, match="length 200 and its answer need"):
    passkey(model, params, tokenizer, PasskeyConfig(lengths=(60, 200)))
  with pytest.raises(ValueError, match="must be distinct"):
    PasskeyConfig(lengths=(60, 60))
  with pytest.raises(ValueError, match="PasskeyConfig.wording must be one of"):
    PasskeyConfig(wording="magic number")


def test_kvjax_eval_recall_writes_a_record_per_sample(tmp_path, capsys):
  """`kvjax eval --recall` on a saved hand-built model: the printed rates are those of the
  answers it writes to the workdir, one line per sample, beside the samples it asked."""
  tokenizer = word_tokenizer(True)
  model, params = answering(tokenizer, f"The secret passkey is {KEY}.", max_len=256)
  save_params(tmp_path, params, model.config)
  tokenizer.save(tmp_path)
  assert kvjax_main(["eval", "--workdir", str(tmp_path), "--recall", "100,120", "--needles", "3"]) == 0
  result = json.loads(capsys.readouterr().out)
  inputs, answers = read_jsonl(tmp_path / "samples.jsonl"), read_jsonl(tmp_path / "answers.jsonl")
  assert inputs == all_samples(tokenizer, PasskeyConfig(lengths=(100, 120), needles=3))
  assert [a["id"] for a in answers] == [s["id"] for s in inputs] and {a["method"] for a in answers} == {"full"}
  for a, s in zip(answers, inputs):
    assert a["answer"] == f"The secret passkey is {KEY}." and a["score"] == float(s["references"] == [KEY])
    assert (a["depth"], a["distance"], a["length"]) == (s["depth"], s["distance"], s["length"])
  for n in ("100", "120"):
    assert result["recall"][n]["recall"] == np.mean([a["hit"] for a in answers if a["length"] == int(n)])
    assert result["recall"][n]["needles"] == 3
