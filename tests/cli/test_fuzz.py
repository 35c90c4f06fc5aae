"""Every command-line argument fails cleanly: hypothesis gives each `kvjax` command hostile values
for its arguments and --set items (empty and odd text, directories and files of the wrong kind
where a file or folder is named, non-numbers, zero, negative, huge, infinite and NaN numbers),
and each command line must end in exactly one `kvjax CMD: error: ...` line, the last on stderr,
naming the argument, field, file or value at fault, with exit status 2 and no traceback.

The commands run in this process (kvjax.cli.main.main). What each one does once its arguments
are accepted (training, evaluating, decoding, writing a checkpoint or an export, a benchmark) is
replaced by a tripwire that fails the test: a hostile value must be refused before the work
starts, so no example compiles a model and none can exit 0 having done nothing. Every example
holds at least one hostile value, each refused whatever the others are.

Two tiers: the first draws QUICK examples per command and tries every STRIDE-th --set item
alone; the second (pytest -m tier2) draws WIDE examples and tries every item.
"""

from __future__ import annotations

import itertools
import json
import re
import sys

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax.bench.peers.hf_model
import kvjax.decoding.stream
import kvjax.interop.hf_export
import kvjax.kernels.build
import kvjax.studies.suite.passkey_run
import kvjax.studies.suite.recall
import kvjax.training.checkpoint
import kvjax.training.evaluate
import kvjax.training.train
from kvjax.bench.base.registry import Kind
from kvjax.cli import bench
from kvjax.cli import main as cli
from kvjax.config import ModelConfig
from kvjax.conversion import conversions
from kvjax.conversion.kv_heads import METHODS
from kvjax.interop.kv_size import BYTES_PER_ELEMENT, DTYPE_NAMES
from kvjax.model.transformer import Transformer
from kvjax.training import checkpoint
from kvjax.training.step import param_initializer
from conftest import word_corpus

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=64, max_len=64)
# Examples per command: the first tier's few, the second tier's full breadth (fuzz below).
QUICK, WIDE = 8, 60
STRIDE = 7  # the first tier's share of the --set items tried one by one (test_set_items)
# Derandomized: the same examples on every run, so that CI is reproducible.
FUZZ = settings(
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NEW = itertools.count()


def fuzz(case, **strategies):
  """The hypothesis test of `case` (its arguments: fixtures, then `strategies`, default
  data=st.data()) at two breadths -> (QUICK examples, in the first tier; WIDE examples, marked
  tier2). The derandomized draws of both begin alike."""
  strategies = strategies or {"data": st.data()}
  quick = settings(FUZZ, max_examples=QUICK)(given(**strategies)(case))
  wide = settings(FUZZ, max_examples=WIDE)(given(**strategies)(case))
  return quick, pytest.mark.tier2(wide)


# Hostile values, as the command line gives them (text).
HUGE = (2**31, 2**63, 10**30)  # past JAX's int32 indices, past int64, far past both
NOT_FINITE = ("nan", "NaN", "inf", "-inf", "1e400", "-1e400")  # 1e400 reads as inf
ODD = (
  "",
  " ",
  "\t\n",
  "\x00",
  "\ud800",
  "é",
  "☃",
  "\u200b",
  "x" * 5000,
  "-",
  "=",
  ",",
  ":",
  "None",
  "[]",
  "()",
  "{}",
  "1.5",
  "1e3",
  "10**30",
  "0x10",
  "1,2",
)
NOT_PATHS = ("", " ", "\x00", "a\x00b", "\ud800")  # blank, or what no file name holds
PATH_ODD = (*NOT_PATHS, "missing/deeper")  # and a path to nothing (where a command would create it)


def refuses(parse, text: str) -> bool:
  try:
    parse(text)
  except (ValueError, OverflowError):
    return True
  return False


def not_a(parse) -> st.SearchStrategy[str]:
  """Text that `parse` (int, float) refuses: odd strings, and any short text it does."""
  return st.one_of(st.sampled_from(ODD + NOT_FINITE), st.text(max_size=8)).filter(lambda t: refuses(parse, t))


BAD_COUNT = st.one_of(not_a(int), st.integers(max_value=0).map(str), st.sampled_from(HUGE).map(str))
BAD_NONNEGATIVE = st.one_of(not_a(int), st.integers(max_value=-1).map(str), st.sampled_from(HUGE).map(str))
BAD_SEED = st.one_of(not_a(int), st.integers(max_value=-1).map(str), st.sampled_from(HUGE[1:]).map(str))
BAD_STEP = st.one_of(not_a(int), st.sampled_from((-1, 1, 7, *HUGE)).map(str))  # the workdirs hold step 0 only
BAD_MESH = st.sampled_from(
  (
    "",
    " ",
    "data=0",
    "data=-1",
    "model=nan",
    "data=1e400",
    f"data={10**30}",
    "data=4096",
    "x=1",
    "data",
    "=",
    ",",
    "data=1,data=1",
    "model=2,model=2",
    "\x00",
  )
)


def bad_choice(*valid: str) -> st.SearchStrategy[str]:
  """Text that is none of `valid` (in any case)."""
  valid = {v.lower() for v in valid}
  return st.one_of(st.sampled_from(ODD + ("int3", "Float32", "float64", "val ")), st.text(max_size=6)).filter(
    lambda t: t.strip().lower() not in valid
  )


def option(flag: str, values: st.SearchStrategy[str]) -> st.SearchStrategy[tuple[list[str], list[str]]]:
  """(argv items, clues) of `flag` given a hostile value; the error line must hold a clue."""
  name = flag.lstrip("-")
  return values.map(lambda v: ([f"{flag}={v}"], [flag, name.replace("-", "_"), name.replace("-", " "), v]))


# --set items each refused whatever the other items and the config are.
MALFORMED = (
  "foo",
  "=",
  "=1",
  " = ",
  "x.y",
  "x.y=1",
  "\x00=1",
  "model.=1",
  "model..d_model=1",
  ".=1",
  "model",
  "cache",
  "model.d_model",
  "cache.dtype",
)
BAD_INT_LITERALS = (
  "-1",
  "0",
  "1e400",
  "-1e400",
  "10**30",
  str(10**30),
  str(2**31),
  "1.5",
  "nan",
  "'8'",
  "True",
  "[1]",
  "(1,)",
  "{}",
  "",
)
BAD_REAL_LITERALS = ("0", "-1", "1e400", "-1e400", "nan", "'x'", "True", "[1.0]", "None", "")


def items(section: str, names: tuple[str, ...], values: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(f"{section}.{name}={value}" for name in names for value in values)


MODEL_ITEMS = (
  *items(
    "model",
    ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "max_len", "head_dim", "mlp_dim"),
    BAD_INT_LITERALS,
  ),
  *items("model", ("norm_eps", "rope_theta"), BAD_REAL_LITERALS),
  *items("model", ("activation", "norm", "positions", "dtype"), ("int3", "''", "1", "None", "GELU", "float64")),
  "model.window=(0,-1)",
  "model.window=(-1,)",
  "model.window=(1e400,)",
  "model.window=1e400",
  f"model.window=({10**30},)",
  f"model.window=({2**31},)",
  "model.window='x'",
  "model.window=(1.5,)",
  "model.sink_tokens=-1",
  f"model.sink_tokens={10**30}",
  "model.sink_tokens=1e400",
  "model.kv_latent_rank=-1",
  f"model.kv_latent_rank={10**30}",
  "model.rope_dims=-2",
  "model.rope_pairs=((1,),)",
  "model.qkv_bias=1",
  "model.tie_embeddings='yes'",
  "model.rope_scaling=3",
  "model.rope_scaling={'factor': 1e400}",
  "model.rope_scaling={'factor': 0.5}",
  "model.rope_scaling={'original_max_position': 0}",
  "model.rope_scaling={'low_freq_factor': 4, 'high_freq_factor': 1}",
  "model.rope_scaling={'kind': 'yarn'}",
  "model.rope_scaling={'nope': 1}",
  "model.rope_scaling={'factor': float('nan')}",
)
CACHE_ITEMS = (
  *items("cache", ("page_size",), BAD_INT_LITERALS),
  *items("cache", ("sink_tokens",), ("-1", "1e400", str(10**30), "1.5", "'4'", "nan")),
  *items("cache", ("window",), ("(0,-1)", "(-1,)", "(1e400,)", "1e400", f"({10**30},)", "'x'", "(True,)", "[1.5]")),
  "cache.dtype=int3",
  "cache.dtype=''",
  "cache.dtype=1",
  "cache.dtype=float64",
  "cache.dtype=int2",
  "cache.layout=",
  "cache.layout=Paged",
  "cache.layout=1",
  "cache.layout=evict",
  "cache.press=h2o",
  "cache.press=SnapKV",
  "cache.press=1",
  "cache.press={'window': 8}",
  "cache.press={'name': 'snapkv', 'window': 0}",
  "cache.press={'name': 'snapkv', 'kernel': 4}",
  "cache.press={'name': 'tova', 'window': 8}",
  "cache.press={'name': 'knorm', 'compression_ratio': 1.0}",
  "cache.press={'name': 'knorm', 'heads': 'adakv'}",
  "cache.press.window=8",
  "cache.press.nope=1",
  "cache.paged_read=pallas",
  "cache.paged_read=x",
  "cache.absorb=1",
  "cache.absorb='yes'",
  "cache.absorb=None",
  "cache.nope=1",
  "cache.=1",
)
TRAIN_ITEMS = (
  *items(
    "train",
    ("steps", "batch_size", "eval_batches", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"),
    BAD_INT_LITERALS,
  ),
  *items("train", ("lr", "clip_norm"), BAD_REAL_LITERALS),
  *items("train", ("min_lr_ratio", "b1", "b2"), ("-0.1", "1.5", "1e400", "nan", "'x'", "None")),
  "train.warmup_steps=-1",
  f"train.warmup_steps={10**30}",
  "train.seed=-1",
  f"train.seed={10**30}",
  "train.weight_decay=-1",
  "train.weight_decay=1e400",
  "train.distill=-1",
  "train.distill=1e400",
  "train.bf16=1",
  "train.mesh=data=0",
  "train.mesh=''",
  "train.mesh=x",
  "train.mesh=data=4096",
  "data.source=",
  "data.max_bytes=0",
  "data.max_bytes=1e400",
  "data.seq_len=0",
  f"data.seq_len={10**30}",
  "data.val_fraction=0",
  "data.val_fraction=0.9",
  "data.val_fraction=nan",
  "data.held_out=middle",
  "data.seed=-1",
  "data.source=' '",
  "data.source='\\x00'",
  "data.source='\\ud800'",
  "job=",
  "job='not a job'",
  "job=1",
)
WEIGHT_ITEMS = ("weights=int3", "weights=", "weights=1", "weights=float16")
# The --set items each command takes: those of its config, and the ones it has no key for.
SET_ITEMS = {
  "run": MALFORMED + MODEL_ITEMS + TRAIN_ITEMS + CACHE_ITEMS + WEIGHT_ITEMS,
  "eval": MALFORMED + CACHE_ITEMS + MODEL_ITEMS + WEIGHT_ITEMS,
  "generate": MALFORMED + CACHE_ITEMS + MODEL_ITEMS + WEIGHT_ITEMS,
  "bench": MALFORMED + MODEL_ITEMS + CACHE_ITEMS + WEIGHT_ITEMS,
  "uptrain": MALFORMED + MODEL_ITEMS + TRAIN_ITEMS,
}


def set_clues(item: str) -> list[str]:
  """What the error line of --set ITEM names: the item, its key, the key's last part or the value."""
  key, _, value = item.partition("=")
  return [item, key.strip(), key.strip().rpartition(".")[2], value.strip()]


def sets(command: str) -> st.SearchStrategy[tuple[list[str], list[str]]]:
  """--set ITEM for one of the command's hostile items."""
  return st.sampled_from(SET_ITEMS[command]).map(lambda item: (["--set", item], set_clues(item)))


class Tripwire(BaseException):
  """Raised by the work a command does once its arguments are accepted (a BaseException, so that
  no `except Exception` on the way turns it into an error line)."""


def tripwire(name: str):
  def called(*args, **kwargs):
    raise Tripwire(f"{name} was called")

  return called


class NoTorch:
  def __getattr__(self, name):
    raise Tripwire("torch was used")


def clue_in(clue: str, line: str) -> bool:
  """`clue` is in the error line: quoted as Python writes it, or as it is (in any case) when it says
  something."""
  text = clue.strip().lower()
  return repr(clue) in line or (len(text) >= 2 and (text in line.lower() or ascii(clue)[1:-1] in line))


def refused(argv: list[str], clues: list[str], capsys) -> None:
  """Runs `kvjax ARGV` and checks it ends in one error line naming a clue, status 2, no traceback."""
  try:
    code = cli.main(argv)
  except SystemExit as exit_:
    code = exit_.code
  except Tripwire as err:
    raise AssertionError(f"{err}: kvjax {argv} was not refused before its work") from None
  out, err = capsys.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  errors = [line for line in lines if re.match(r"kvjax[^:]*: error: ", line)]
  assert code == 2 and "Traceback" not in err, f"kvjax {argv}: exit {code}\n{out[-2000:]}\n{err[-4000:]}"
  # `kvjax bench NAME` refuses its own options as `kvjax bench NAME: error: ...`
  prefixes = (f"kvjax {argv[0]}: error: ", f"kvjax {' '.join(argv[:2])}: error: ")
  assert errors == lines[-1:] and lines[-1].startswith(prefixes), f"kvjax {argv}:\n{err}"
  assert any(clue_in(c, lines[-1]) for c in clues), f"kvjax {argv}: {lines[-1]!r} names none of {clues}"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
  """Paths of the right and the wrong kinds: a config file and a workdir that work, files and
  folders that are not what a command asks for."""
  root = tmp_path_factory.mktemp("fuzz")
  corpus = word_corpus(root / "words.txt")
  (root / "config.py").write_text(
    "from kvjax.config import ModelConfig\n"
    "from kvjax.training.config import DataConfig, TrainConfig, TrainRun\n"
    f"def get_config():\n  return TrainRun(model={MODEL!r}, data=DataConfig(source={str(corpus)!r}, seq_len=32),\n"
    "                  train=TrainConfig(steps=2, batch_size=2, warmup_steps=1))\n"
  )
  workdir = root / "imported"
  checkpoint.save_params(workdir, param_initializer(Transformer(MODEL))(jax.random.key(0)), MODEL)
  notes = root / "notes"
  notes.mkdir()
  (notes / "todo.txt").write_text("mine")
  (root / "empty_dir").mkdir()
  (root / "cwd").mkdir()
  texts = {
    "empty": "",
    "empty.py": "",
    "model.gguf": "not a gguf\n",
    "garbage.json": "{garbage",
    "model.safetensors": "\x00\x01",
    "noget.py": "x = 1\n",
    "syntax.py": "{{{\n",
    "notdc.py": "def get_config():\n  return 3\n",
    "nojob.py": "def get_config():\n  return {'job': 'train'}\n",
  }
  for name, text in texts.items():
    (root / name).write_text(text)
  (root / "nul.py").write_bytes(b"\x00\xff\xfe")
  (root / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
  hf_configs = {
    "hf_garbage": "{garbage",
    "hf_partial": json.dumps({"model_type": "llama", "hidden_size": -1}),
    "hf_unknown": json.dumps({"model_type": "bert"}),
  }
  for name, config in hf_configs.items():
    (root / name).mkdir()
    (root / name / "config.json").write_text(config)
  return {p.name: str(p) for p in root.iterdir()} | {"root": str(root), "missing": str(root / "missing")}


@pytest.fixture
def tripwires(monkeypatch, files):
  """The work of each command replaced by a tripwire; the scratch folder as working directory."""
  monkeypatch.chdir(files["cwd"])
  for module, name in (
    (kvjax.training.train, "make_optimizer"),
    (kvjax.training.evaluate, "_eval_sums"),
    (kvjax.decoding.stream, "prefill"),
    (kvjax.studies.suite.recall, "recall"),
    (kvjax.studies.suite.passkey_run, "passkey"),
    (kvjax.interop.hf_export, "save_file"),
    (kvjax.training.checkpoint, "save_params"),
    (conversions.KVHeads, "convert"),
    (conversions.ToMLA, "convert"),
    (kvjax.bench.peers.hf_model, "hf_reference"),
    (kvjax.kernels.build, "build"),
  ):
    monkeypatch.setattr(module, name, tripwire(f"{module.__name__}.{name}"))
  monkeypatch.setattr(kvjax.bench.peers.hf_model, "import_torch", lambda: (NoTorch(), NoTorch()))
  for benchmark in bench.BENCHMARKS.values():  # each benchmark's measuring functions, bench_*
    module = sys.modules[benchmark.run.__module__]
    for name in [n for n in vars(module) if n.startswith("bench_") and callable(getattr(module, n))]:
      monkeypatch.setattr(module, name, tripwire(f"{module.__name__}.{name}"))


def paths(files: dict[str, str], *names: str, odd: tuple[str, ...] = PATH_ODD) -> st.SearchStrategy[str]:
  """The files `names` of the fixture, and odd paths."""
  return st.sampled_from([files[n] for n in names] + list(odd))


def new_path(files: dict[str, str]) -> str:
  return f"{files['root']}/new{next(NEW)}"


def draw_pieces(data, pieces, *, at_least: int = 1) -> tuple[list[str], list[str]]:
  """1 or 2 hostile pieces (at_least 0: up to 2), as (argv items, clues)."""
  drawn = data.draw(st.lists(st.one_of(*pieces), min_size=at_least, max_size=2))
  return [a for argv, _ in drawn for a in argv], [c for _, clues in drawn for c in clues]


def draw_positional(data, name: str, valid: str, hostile: st.SearchStrategy[str]) -> tuple[str, list[str], bool]:
  """(value, clues, whether it is hostile) of the positional argument `name`."""
  value = data.draw(st.one_of(st.just(None), hostile))
  return (valid, [], False) if value is None else (value, [value, name], True)


WORKDIRS = ("model.gguf", "empty", "notes", "missing", "empty_dir", "config.py")  # no checkpoint in any


def run_case(files, tripwires, capsys, data):
  config, clues, hostile = draw_positional(
    data,
    "config",
    files["config.py"],
    st.one_of(
      paths(
        files,
        "notes",
        "empty",
        "empty.py",
        "model.gguf",
        "garbage.json",
        "noget.py",
        "syntax.py",
        "notdc.py",
        "nojob.py",
        "nul.py",
        "missing",
      ),
      st.sampled_from(("-", "config", "é.py")),
      st.text(max_size=6),
    ).filter(lambda t: not t.startswith("-") or t == "-"),
  )
  corpora = paths(files, "notes", "empty_dir", "missing", "model.gguf", "empty")
  pieces = [
    sets("run"),
    corpora.map(lambda p: (["--set", f"data.source={p!r}"], [p, "source"])),
    option("--workdir", paths(files, "empty", "notes", "imported", "model.gguf", odd=NOT_PATHS)),
    option("--mesh", BAD_MESH),
  ]
  argv, more = draw_pieces(data, pieces, at_least=0 if hostile else 1)
  refused(["run", config, "--workdir", new_path(files), *argv], clues + more, capsys)


test_run, test_run_wide = fuzz(run_case)


def decode_pieces(files: dict[str, str], command: str) -> list:
  """The hostile pieces of the commands that decode a checkpoint (eval, generate)."""
  return [
    option("--workdir", paths(files, *WORKDIRS)),
    option("--step", BAD_STEP),
    option("--mesh", BAD_MESH),
    sets(command),
  ]


def eval_case(files, tripwires, capsys, data):
  pieces = decode_pieces(files, "eval") + [
    option("--batches", BAD_COUNT),
    option("--batch-size", BAD_COUNT),
    option("--seq-len", st.one_of(BAD_COUNT, st.sampled_from(("65", "1000")))),  # the model holds 64
    option("--split", bad_choice("val", "train")),
    option("--corpus", paths(files, "notes", "missing", "model.gguf", "empty_dir")),
    option("--recall", st.sampled_from(("", " ", "0", "-1", "1,,2", "nan", "1e400", "a,b", str(10**30), "5,0"))),
    option("--needles", BAD_COUNT),
    option("--needle-bytes", BAD_COUNT),
    option("--seed", BAD_SEED),
  ]
  argv, clues = draw_pieces(data, pieces)
  refused(["eval", "--workdir", files["imported"], *argv], clues, capsys)


test_eval, test_eval_wide = fuzz(eval_case)


def generate_case(files, tripwires, capsys, data):
  temperatures = st.one_of(not_a(float), st.sampled_from(NOT_FINITE), st.floats(max_value=-1e-9).map(repr))
  top_ps = st.one_of(
    not_a(float),
    st.sampled_from(NOT_FINITE + ("0", "-0.0", "1.0000001", "2")),
    st.floats(max_value=0).map(repr),
    st.floats(min_value=1.0000001).map(repr),
  )
  pieces = decode_pieces(files, "generate") + [
    option("--prompt", st.sampled_from(("", "\ud800", "a\udfffb"))),
    option("--temperature", temperatures),
    option("--top-k", BAD_COUNT),
    option("--top-p", top_ps),
    option("--seed", BAD_SEED),
    option("--max-new-tokens", st.one_of(BAD_COUNT, st.sampled_from(("64", "1000")))),  # 2 + 64 - 1 > 64
    st.just((["--chat"], ["--chat"])),
    st.just((["--system", "be brief"], ["--system"])),
  ]  # a byte-level model
  argv, clues = draw_pieces(data, pieces)
  refused(["generate", "--workdir", files["imported"], "--prompt", "hi", "--max-new-tokens", "4", *argv], clues, capsys)


test_generate, test_generate_wide = fuzz(generate_case)


def export_hf_case(files, tripwires, capsys, data):
  pieces = [
    option("--workdir", paths(files, *WORKDIRS)),
    option("--step", BAD_STEP),
    option("--out", paths(files, "empty", "notes", "imported", "model.gguf", odd=NOT_PATHS)),
  ]
  argv, clues = draw_pieces(data, pieces)
  refused(["export-hf", "--workdir", files["imported"], "--out", new_path(files), *argv], clues, capsys)


test_export_hf, test_export_hf_wide = fuzz(export_hf_case)


def import_case(files, tripwires, capsys, data):
  command = data.draw(st.sampled_from(("import", "import-hf")))
  source = data.draw(
    st.one_of(
      paths(
        files,
        "notes",
        "empty_dir",
        "empty",
        "model.gguf",
        "truncated.gguf",
        "garbage.json",
        "model.safetensors",
        "hf_garbage",
        "hf_partial",
        "hf_unknown",
        "imported",
        "config.py",
        "missing",
      ),
      st.sampled_from(("smollm3-135m", "smollm2", "gpt2", "llama")),
    )
  )
  pieces = [
    option("--workdir", paths(files, "empty", "notes", "imported", "model.gguf")),
    option("--dtype", bad_choice("float32", "bfloat16", "float16")),
  ]
  argv, clues = draw_pieces(data, pieces, at_least=0)
  clues += [source, "source", "argument", "config.json", "model_type"]  # a folder's config.json, named as such
  refused([command, source, "--workdir", new_path(files), *argv], clues, capsys)


test_import, test_import_wide = fuzz(import_case)


def kv_size_case(files, tripwires, capsys, data):
  valid = data.draw(st.sampled_from((files["config.py"], files["imported"], "GPT-2")))
  model, clues, hostile = draw_positional(
    data,
    "model",
    valid,
    paths(
      files,
      "notes",
      "empty_dir",
      "empty",
      "model.gguf",
      "truncated.gguf",
      "garbage.json",
      "hf_partial",
      "noget.py",
      "notdc.py",
      "missing",
    ),
  )
  not_positive = st.one_of(not_a(int), st.integers(max_value=0).map(str), st.integers(min_value=2**31).map(str))
  pieces = [option(flag, not_positive) for flag in ("--context", "--batch", "--devices", "--page-size")] + [
    option("--dtype", bad_choice(*DTYPE_NAMES)),
    option("--weight-dtype", bad_choice(*BYTES_PER_ELEMENT)),
    option("--layout", bad_choice("contiguous", "paged")),
    option("--device-memory", st.sampled_from(("", " ", "nan", "infGB", "1e400GB", "-5GB", "5XB", "GB", "1.2.3"))),
    option("--mla", st.sampled_from(("0:0", "-1:-1", "x", ":", "1e400:2", f"{10**30}:2", "8:-2", "8:x"))),
  ]
  argv, more = draw_pieces(data, pieces, at_least=0 if hostile else 1)
  refused(["kv-size", model, *argv], clues + more, capsys)


test_kv_size, test_kv_size_wide = fuzz(kv_size_case)


def bench_pieces(files: dict[str, str], name: str) -> list:
  """Hostile pieces of `kvjax bench NAME`: a hostile value for each of its options (from the
  benchmark's declaration, kvjax.bench.base.registry), a hostile --set item where it takes --set, and
  an option that only other benchmarks take."""
  benchmark = bench.BENCHMARKS[name]
  hostile = {
    Kind.COUNT: BAD_COUNT,
    Kind.NONNEGATIVE: BAD_NONNEGATIVE,
    Kind.COUNTS: st.one_of(not_a(int), st.sampled_from(("0", "1,-1", "64,", ",", str(10**30), "1e400"))),
    Kind.NAMES: st.sampled_from(("", ",", "decode,bogus", "engines", "decode;prefill")),
    Kind.SOURCE: paths(files, "notes", "empty", "model.gguf", "hf_garbage", "hf_partial", "missing"),
    Kind.PROGRAM: paths(files, "notes", "empty", "config.py", "missing"),
  }
  pieces = [option(o.flag, hostile[o.kind]) for o in benchmark.options]
  if benchmark.config is not None:
    pieces.append(sets("bench"))
  own = {o.flag for o in benchmark.options}
  others = sorted({o.flag for b in bench.BENCHMARKS.values() for o in b.options} - own)
  pieces.append(st.sampled_from(others).map(lambda flag: ([flag, "1"], [flag, "unrecognized arguments"])))
  return pieces


def bench_case(files, tripwires, capsys, data):
  name = data.draw(st.sampled_from(sorted(bench.BENCHMARKS)))
  benchmark, clues, hostile = draw_positional(
    data, "benchmark", name, bad_choice(*bench.BENCHMARKS).filter(lambda t: not t.startswith("-"))
  )
  argv, more = draw_pieces(data, bench_pieces(files, name), at_least=0 if hostile else 1)
  # A pretrained model where the benchmark needs one, given before the pieces (a hostile --model replaces it).
  required = [f"{o.flag}=smollm2-135m" for o in bench.BENCHMARKS[name].options if o.required]
  refused(["bench", benchmark, *required, *argv], clues + more, capsys)


test_bench, test_bench_wide = fuzz(bench_case)


def uptrain_case(files, tripwires, capsys, data):
  fractions = st.one_of(not_a(float), st.sampled_from(NOT_FINITE + ("-0.1", "1.5")))
  workdirs = st.sampled_from([files["imported"], files["empty"], files["notes"], *NOT_PATHS])
  sources = paths(files, *WORKDIRS)
  pieces = [
    option("--from", sources),
    option("--workdir", workdirs),
    option("--kv-heads", st.one_of(BAD_COUNT, st.just("3"))),  # 3 does not divide the 2 kv heads
    option("--to-mla", BAD_COUNT),
    option("--rope-dims", st.one_of(not_a(int), st.just("-1"))),
    option("--method", bad_choice(*METHODS)),
    option("--seed", st.one_of(not_a(int), st.integers(max_value=-1).map(str), st.integers(min_value=2**63).map(str))),
    option("--fraction", fractions),
    option("--distill", st.one_of(not_a(float), st.sampled_from(NOT_FINITE + ("-1",)))),
    option("--mesh", BAD_MESH),
    sets("uptrain"),
  ]
  argv, clues = draw_pieces(data, pieces)
  refused(
    ["uptrain", "--from", files["imported"], "--workdir", new_path(files), "--kv-heads", "1", "--fraction", "0", *argv],
    clues,
    capsys,
  )


test_uptrain, test_uptrain_wide = fuzz(uptrain_case)


def build_kernels_case(tripwires, capsys, extra):
  refused(["build-kernels", *extra], ["unrecognized arguments", "expected one argument"], capsys)


test_build_kernels, test_build_kernels_wide = fuzz(
  build_kernels_case,
  extra=st.lists(
    st.one_of(
      st.sampled_from(("x", "--set", "x=1", "--workdir", "run", "-v")),
      st.text(min_size=1, max_size=6).filter(lambda t: not t.startswith("-")),
    ),
    min_size=1,
    max_size=3,
  ),
)


def base_argv(files: dict[str, str], command: str) -> list[str]:
  """A command line of `command` that its hostile pieces are added to."""
  return {
    "run": ["run", files["config.py"], "--workdir", new_path(files)],
    "eval": ["eval", "--workdir", files["imported"]],
    "generate": ["generate", "--workdir", files["imported"], "--prompt", "hi", "--max-new-tokens", "4"],
    "bench": ["bench", "decode"],
    "uptrain": [
      "uptrain",
      "--from",
      files["imported"],
      "--workdir",
      new_path(files),
      "--kv-heads",
      "1",
      "--fraction",
      "0",
    ],
  }[command]


@pytest.mark.parametrize(
  "stride", [pytest.param(STRIDE, id="sample"), pytest.param(1, id="every", marks=pytest.mark.tier2)]
)
@pytest.mark.parametrize("command", ["run", "eval", "generate", "bench"])
def test_set_items(files, tripwires, capsys, command, stride):
  """The --set items the tests above draw from, each alone: every STRIDE-th in the first tier,
  all of them in the second (uptrain's are run's, applied by the same
  kvjax.fields.apply_overrides to the same configs, after a checkpoint read)."""
  failures = []
  for item in SET_ITEMS[command][::stride]:
    try:
      refused([*base_argv(files, command), "--set", item], set_clues(item), capsys)
    except AssertionError as err:
      failures.append(str(err).splitlines()[0])
  assert not failures, "\n".join(failures)
