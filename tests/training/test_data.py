"""Byte tokenizer, corpora (file, directory, stdlib), held-out split and seeded windows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvjax.interop.tokenizer import TextTokenizer

from kvjax.training import data
from kvjax.training.config import DataConfig


@pytest.mark.parametrize("text", ["hello, world\n", "遥遥领先", "naïve café ☕ \x00 tab\t", ""])
def test_utf8_round_trip(text):
  ids = data.encode(text)
  assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
  assert ((ids >= 0) & (ids < data.VOCAB_SIZE)).all()
  assert data.decode(ids) == text


def test_decode_cut_character_and_bad_ids():
  ids = data.encode("遥")  # three bytes
  assert data.decode(ids[:2]) == "\ufffd"
  with pytest.raises(ValueError, match="token id 300 is not a byte"):
    data.decode([65, 300])


def test_file_corpus_and_split(tmp_path):
  text = "".join(f"line {i}: the quick brown fox\n" for i in range(200)).encode()
  path = tmp_path / "corpus.txt"
  path.write_bytes(text)
  ds = data.load_dataset(DataConfig(source=str(path), val_fraction=0.1, seq_len=16))
  assert ds.info.num_bytes == len(text) and ds.info.num_files == 1
  assert ds.info.sha256 == hashlib.sha256(text).hexdigest()
  held = data.held_out_mask(len(text), 0.1)
  corpus = np.frombuffer(text, np.uint8)
  assert ds.val.tobytes() == corpus[held].tobytes() and ds.train.tobytes() == corpus[~held].tobytes()
  assert abs(len(ds.val) / len(text) - 0.1) < 0.02  # nothing lost, the asked-for fraction held out
  quarters = np.array_split(held, 4)
  assert all(q.any() for q in quarters) and not held.all()  # held-out blocks cover the whole corpus
  tail = data.load_dataset(DataConfig(source=str(path), val_fraction=0.1, held_out="tail", seq_len=16))
  cut = len(text) - round(0.1 * len(text))
  assert tail.val.tobytes() == text[cut:] and tail.train.tobytes() == text[:cut]
  with pytest.raises(ValueError, match=r"DataConfig.held_out must be one of \('spread', 'tail'\), got 'end'"):
    DataConfig(held_out="end")
  with pytest.raises(ValueError, match="held-out rule must be 'spread' or 'tail', got 'Tail'"):
    data.held_out_mask(100, 0.1, "Tail")


def test_max_bytes_caps_the_corpus(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"a" * 1000)
  corpus, info = data.load_corpus(DataConfig(source=str(tmp_path / "a.txt"), max_bytes=300))
  assert len(corpus) == 300 and info.num_bytes == 300


def test_directory_corpus_is_sorted_and_skips_hidden(tmp_path):
  (tmp_path / "b.txt").write_text("BBBB")
  (tmp_path / "a.txt").write_text("AAAA")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "c.md").write_text("CCCC")
  (tmp_path / ".git").mkdir()
  (tmp_path / ".git" / "HEAD").write_text("hidden")
  corpus, info = data.load_corpus(DataConfig(source=str(tmp_path)))
  assert corpus.tobytes() == b"AAAABBBBCCCC"
  assert info.num_files == 3
  corpus, info = data.load_corpus(DataConfig(source=str(tmp_path), max_bytes=6))
  assert corpus.tobytes() == b"AAAABB" and info.num_files == 2


def test_stdlib_corpus_is_deterministic_and_capped():
  config = DataConfig(source="stdlib", max_bytes=200_000)
  corpus, info = data.load_corpus(config)
  again, info_again = data.load_corpus(config)
  assert info == info_again and np.array_equal(corpus, again)
  assert info.num_bytes == 200_000 and info.num_files > 1
  assert info.sha256 == hashlib.sha256(corpus.tobytes()).hexdigest()
  text = corpus.tobytes().decode("utf-8", errors="replace")
  assert "def " in text and "import " in text
  root, files = data.corpus_files("stdlib")
  assert not any(part in data.STDLIB_SKIP for f in files for part in f.relative_to(root).parts)


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda p: str(p / "missing.txt"), "no such file or directory"),
    (lambda p: str(p), "no files found"),
  ],
)
def test_bad_sources(tmp_path, make, message):
  with pytest.raises(ValueError, match=message):
    data.load_corpus(DataConfig(source=make(tmp_path)))


def test_too_small_corpus(tmp_path):
  (tmp_path / "tiny.txt").write_text("x" * 100)
  with pytest.raises(ValueError, match="too small for windows of seq_len"):
    data.load_dataset(DataConfig(source=str(tmp_path / "tiny.txt"), seq_len=32))


def test_windows_are_shifted_targets():
  tokens = np.arange(100, dtype=np.uint8)
  sampler = data.WindowSampler(tokens, seq_len=8, batch_size=4, seed=0)
  inputs, targets = sampler.next()
  assert inputs.shape == targets.shape == (4, 8) and inputs.dtype == np.int32
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  np.testing.assert_array_equal(targets - inputs, 1)  # consecutive bytes of the corpus
  assert inputs.min() >= 0 and targets.max() <= 99


def test_sampler_state_resumes_the_same_sequence():
  tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
  full = data.WindowSampler(tokens, 16, 4, seed=3)
  expected = [full.next() for _ in range(6)]
  first = data.WindowSampler(tokens, 16, 4, seed=3)
  for _ in range(3):
    first.next()
  state = first.state()
  assert state["position"] == 3
  resumed = data.WindowSampler(tokens, 16, 4, seed=3)
  resumed.restore(state)
  for want in expected[3:]:
    got = resumed.next()
    np.testing.assert_array_equal(got[0], want[0])
  other = data.WindowSampler(tokens, 16, 4, seed=4).next()
  assert not np.array_equal(other[0], expected[0][0])


def test_eval_batches_are_fixed():
  tokens = np.arange(1000, dtype=np.int64) % 256
  a = list(data.eval_batches(tokens.astype(np.uint8), 8, 4, 3))
  b = list(data.eval_batches(tokens.astype(np.uint8), 8, 4, 3))
  assert len(a) == 3
  for (x1, y1), (x2, y2) in zip(a, b):
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
  starts = np.concatenate([x[:, 0] for x, _ in a])
  assert starts[0] == 0 and starts[-1] == (1000 - 9) % 256


def test_retokenize_keeps_splits_and_measures_bytes_per_token(tmp_path):
  path = tmp_path / "c.txt"
  path.write_text("abcdefgh" * 100)
  ds = data.load_dataset(DataConfig(source=str(path), seq_len=8, val_fraction=0.25))
  pairs = lambda text: [ord(text[i]) * 2 + (i // 2) % 2 for i in range(0, len(text), 2)]  # 2 bytes/token
  re = data.retokenize(ds, pairs)
  assert len(re.val) == len(ds.val) // 2 and len(re.train) == len(ds.train) // 2
  assert re.bytes_per_token == 2.0 and re.val.dtype == np.int32
  assert re.info == ds.info and re.seq_len == 8
  with pytest.raises(ValueError, match="too few for windows"):
    data.retokenize(ds, lambda text: [1] * 5)


def test_load_dataset_with_a_tokenizer_gives_its_ids(tmp_path):
  tokenizers = pytest.importorskip("tokenizers", reason="needs the tokenizers package")
  path = tmp_path / "c.txt"
  path.write_text("hello world " * 200)
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  config = DataConfig(source=str(path), seq_len=8, val_fraction=0.25)
  ids = data.load_dataset(config, TextTokenizer(tok))
  want = data.retokenize(data.load_dataset(config), lambda text: tok.encode(text, add_special_tokens=False).ids)
  np.testing.assert_array_equal(ids.train, want.train)
  np.testing.assert_array_equal(ids.val, want.val)
  assert set(np.unique(ids.train).tolist()) <= {0, 1, 2} and ids.bytes_per_token > 5
