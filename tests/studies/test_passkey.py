"""The pass-key test: where its needle lies, its chat and plain frames, its determinism, its
scoring, its paged answers against the contiguous cache, and its refusals."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest

from kvjax.cache.config import CacheConfig
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.studies import measure
from kvjax.studies.passkey import (
  ANSWER,
  INSTRUCTION,
  NEEDLE,
  PARAGRAPH,
  QUESTION,
  SEPARATOR,
  Frame,
  PasskeyConfig,
  Prose,
  answered,
  examples,
  passkey,
  prose_sentences,
)
from kvjax.training.data import documentation
from conftest import init_params, tiny_config

tokenizers = pytest.importorskip("tokenizers", reason="needs the tokenizers package")

CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_OPENING, CHAT_CLOSING = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
SPECIAL = ("<unk>", "<s>", "<|im_start|>", "<|im_end|>")


@functools.cache
def word_tokenizer(chat: bool) -> TextTokenizer:
  """A word-level tokenizer over the held-out documentation and the prompt's own words: a word
  with the space before it, a digit, any other character, each one token; decode joins them
  back into the text. With a chat template (ChatML) or without one (then a bos starts a prompt)."""
  split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r" ?[A-Za-z]+| ?[0-9]|\s|[^\sA-Za-z0-9]"), "isolated")
  sentences = [(before + sentence, sentence) for before, sentence in prose_sentences(documentation()[1].decode())]
  texts = (
    *(text for pair in sentences for text in pair),
    INSTRUCTION,
    SEPARATOR + PARAGRAPH,
    NEEDLE.format(key="0123456789 " + " ".join("0123456789")),
    QUESTION,
    ANSWER,
    "user\nassistant",
  )
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


def sentences_of(text: str) -> list[str]:
  return [s for paragraph in text.split(PARAGRAPH) for s in re.split(r"(?<=[.!?]) (?=[A-Z])", paragraph)]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
@pytest.mark.parametrize("distance", [60, 150])
def test_the_needle_lies_exactly_distance_tokens_before_the_prompt_end(chat, distance):
  tokenizer = word_tokenizer(chat)
  prose = Prose.of(tokenizer)
  config = PasskeyConfig(distances=(distance,), needles=4, lead=20, seed=3)
  prompts, lengths, keys = examples(tokenizer, config, distance, prose)
  assert prompts.shape == (4, lengths.max()) and len(set(keys)) == 4
  assert (lengths == Frame.of(tokenizer).length(config.lead, distance)).all()
  whole = {sentence for _, sentence in prose_sentences(documentation()[1].decode())}
  for prompt, length, key in zip(prompts, lengths, keys):
    ids, needle = prompt[:length], tokenizer.encode(NEEDLE.format(key=key))
    assert len(key) == 5 and (ids[length - distance : length - distance + len(needle)] == needle).all()
    text = tokenizer.decode(ids)
    if chat:
      head, tail = CHAT_OPENING + INSTRUCTION + SEPARATOR, SEPARATOR + QUESTION + CHAT_CLOSING
    else:
      assert ids[0] == tokenizer.bos_id and "<|im_start|>" not in text
      head, tail = "<s>" + INSTRUCTION + SEPARATOR, f"{SEPARATOR}{QUESTION} {ANSWER}"
    assert text.startswith(head) and text.endswith(tail) and "<unk>" not in text
    lead, filler = text[len(head) : -len(tail)].split(SEPARATOR + NEEDLE.format(key=key) + SEPARATOR)
    assert set(sentences_of(lead)) | set(sentences_of(filler)) <= whole  # whole sentences of the prose
    assert len(tokenizer.encode(lead)) == config.lead
  again = examples(tokenizer, config, distance, prose)
  assert all((a == b).all() for a, b in zip(again[:2], (prompts, lengths))) and again[2] == keys  # seeded
  other = examples(tokenizer, PasskeyConfig(distances=(distance,), needles=4, lead=20, seed=4), distance, prose)
  assert other[2] != keys


def test_answered_is_the_first_number():
  assert answered(" 48213.", "48213") and answered("The pass key is 48213, I think", "48213")
  assert answered("48213x", "48213")
  assert not answered(" 4821", "48213") and not answered(" 482130", "48213")
  assert not answered("version 3 then 48213", "48213") and not answered("a special method", "48213")


def test_paged_answers_in_batches_equal_the_contiguous_cache():
  tokenizer = word_tokenizer(True)
  model, params = tiny_llama(tokenizer, max_len=160)
  config = PasskeyConfig(distances=(48, 52), needles=2, lead=20, answer_tokens=6, batch_size=2)
  contiguous = passkey(model, params, tokenizer, config)
  paged = dataclasses.replace(config, batch_size=1)  # and one example at a time
  assert passkey(model, params, tokenizer, paged, cache_config=CacheConfig(layout="paged")) == contiguous
  assert list(contiguous) == ["48", "52"]
  for distance, result in contiguous.items():
    _, _, keys = examples(tokenizer, config, int(distance), Prose.of(tokenizer))
    assert [s["key"] for s in result["samples"]] == keys and result["needles"] == 2
    assert [s["index"] for s in result["samples"]] == [0, 1]
  assert any(s["answer"] for r in contiguous.values() for s in r["samples"])  # tokens, not an immediate stop


def test_exact_match_counts_the_answers_that_hold_the_key(monkeypatch):
  """Answers made up by hand (the key for every other example asked, a wrong number for the
  rest) give the exact match counted by hand, per distance, in batches of 2."""
  tokenizer = word_tokenizer(True)
  model, params = tiny_llama(tokenizer, max_len=160)
  config = PasskeyConfig(distances=(48, 52), needles=3, lead=20, answer_tokens=6, batch_size=2)
  asked = []

  def made_up(model, params, prompts, lengths, new_tokens, cache_config, *, stop_ids, question):
    out = []
    for prompt, length in zip(prompts, lengths):
      key = re.search(r"The pass key is (\d+)", tokenizer.decode(prompt[:length])).group(1)
      out.append(tokenizer.encode(f" {key}." if len(asked) % 2 == 0 else " 1234."))
      asked.append(key)
    return out

  monkeypatch.setattr(measure, "answers", made_up)
  found = passkey(model, params, tokenizer, config)
  # Examples 0, 2 of distance 48 and example 1 of distance 52 (the 5th asked) get their key.
  assert [found[d]["exact_match"] for d in ("48", "52")] == [2 / 3, 1 / 3]
  assert [[s["hit"] for s in found[d]["samples"]] for d in ("48", "52")] == [[True, False, True], [False, True, False]]
  assert [s["answer"] for s in found["52"]["samples"]] == [" 1234.", f" {asked[4]}.", " 1234."]


def test_too_short_a_distance_or_model_is_refused():
  tokenizer = word_tokenizer(True)
  prose = Prose.of(tokenizer)
  with pytest.raises(
    ValueError,
    match=r"distances: 20 tokens cannot hold the needle sentence and the question "
    r"\(\d+ tokens",
  ):
    examples(tokenizer, PasskeyConfig(distances=(20,)), 20, prose)
  with pytest.raises(ValueError, match="no run of whole sentences of the pass-key prose has exactly 3 tokens"):
    Prose.of(tokenizer, "Ab cd ef gh. Ij kl mn.").run(3, np.random.default_rng(0))
  model, params = tiny_llama(tokenizer, max_len=128)
  with pytest.raises(ValueError, match="distance 200 needs"):
    passkey(model, params, tokenizer, PasskeyConfig(distances=(60, 200)))
  with pytest.raises(ValueError, match="must be distinct"):
    PasskeyConfig(distances=(60, 60))
