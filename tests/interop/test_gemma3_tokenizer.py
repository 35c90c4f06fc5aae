"""Gemma 3's tokenizer, built from its GGUF by llama.cpp's SentencePiece rules, against llama.cpp:
the ids llama-cpp-python gave for the same file (tests/interop/data/gemma3_token_ids.json, written
by experiments/record_gemma3_tokens.py)."""

import json
import pathlib

import pytest

from kvjax.interop.gguf_tokenizer import SPACE
from kvjax.interop.tokenizer import TextTokenizer

RECORDED = json.loads((pathlib.Path(__file__).parent / "data" / "gemma3_token_ids.json").read_text(encoding="utf-8"))
TEXTS = {record["name"]: record for record in RECORDED["texts"]}


@pytest.mark.parametrize("name", list(TEXTS))
def test_ids_equal_llama_cpp(gemma3_tokenizer, name):
  text, expected = TEXTS[name]["text"], TEXTS[name]["ids"]
  assert gemma3_tokenizer.encode(text, add_special_tokens=True).tolist() == expected


def test_recorded_texts_cover_the_rules():
  """The reference file holds what the rules differ on: whole tokens, runs of spaces, bytes."""
  assert {"chinese", "whitespace", "emoji", "chat", "empty", "jumble"} <= set(TEXTS)
  assert TEXTS["chinese"]["text"] == "我们今天去北京的故宫博物院参观。"
  assert TEXTS["empty"]["ids"] == [2]
  assert 105 in TEXTS["chat"]["ids"] and 106 in TEXTS["chat"]["ids"]  # <start_of_turn>, <end_of_turn> whole
  assert len(TEXTS["pydoc"]["text"]) == 2000


def test_words_are_whole_pieces(gemma3_tokenizer):
  """Hand-read pieces: Gemma's vocabulary holds these words whole ('▁' starts a word after a
  space; no space is prepended to the text), and a run of spaces is one user-defined token."""
  ids = gemma3_tokenizer.encode("The capital of France is  Paris")
  pieces = [gemma3_tokenizer.tokenizer.id_to_token(int(i)) for i in ids]
  assert pieces == ["The", "▁capital", "▁of", "▁France", "▁is", "  ", "Paris"]


def test_decode_round_trips(gemma3_tokenizer):
  """Decoding gives the text back; a '▁' written in the text comes back as a space, as from llama.cpp."""
  for name, record in TEXTS.items():
    ids = record["ids"]
    assert gemma3_tokenizer.decode(ids[1:]) == record["text"].replace(SPACE, " "), name
    assert gemma3_tokenizer.decode(ids) == "<bos>" + record["text"].replace(SPACE, " "), name
  chat = TEXTS["chat"]
  assert "<start_of_turn>" not in gemma3_tokenizer.decode(chat["ids"], skip_special_tokens=True)


def test_special_ids(gemma3_tokenizer):
  tokenizer = gemma3_tokenizer
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id, tokenizer.eot_id) == (2, 1, 0, 3, 106)
  assert tokenizer.add_bos and tokenizer.vocab_size == 262144
  assert tokenizer.chat_template is None
  assert tokenizer.stop_ids == (1, 106)  # <eos> and <end_of_turn>, without a chat template too


def test_save_load_round_trip(gemma3_tokenizer, tmp_path):
  gemma3_tokenizer.save(tmp_path)
  loaded = TextTokenizer.load(tmp_path, vocab_size=262144)
  for name, record in TEXTS.items():
    assert loaded.encode(record["text"], add_special_tokens=True).tolist() == record["ids"], name
  assert (loaded.bos_id, loaded.eos_id, loaded.eot_id, loaded.add_bos, loaded.stop_ids) == (2, 1, 106, True, (1, 106))


def test_space_prefix_refused(gemma3_metadata):
  """llama.cpp prefixes a space after every special token when add_space_prefix is set; refused."""
  metadata = {**gemma3_metadata, "tokenizer.ggml.add_space_prefix": True}
  with pytest.raises(ValueError, match="tokenizer.ggml.add_space_prefix true"):
    TextTokenizer.from_gguf_metadata(metadata)
