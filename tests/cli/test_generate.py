"""`kvjax generate` hands continue_text what its flags say: one Sampling value built from
--temperature / --top-k / --top-p, and the cache --set names, a press chosen by name with its fields."""

from __future__ import annotations

import pytest

import kvjax.cli.generate
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import SnapKV
from kvjax.cli import main as cli


@pytest.fixture
def handed(monkeypatch):
  """The keyword arguments the command gave continue_text (which does no work here)."""
  calls = []
  monkeypatch.setattr(kvjax.cli.generate, "continue_text", lambda *args, **kwargs: calls.append(kwargs) or "")
  return calls


def run(*flags: str) -> int:
  return cli.main(["generate", "--workdir", "runs/none", "--prompt", "hi", *flags])


def test_the_sampling_flags_make_one_sampling_value(handed):
  assert run("--temperature", "0.5", "--top-k", "3", "--top-p", "0.9") == 0
  sampling = handed[0]["sampling"]
  assert (float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)) == (0.5, 3, pytest.approx(0.9))
  assert run() == 0  # the command's defaults: temperature 0.8, no filters
  sampling = handed[1]["sampling"]
  assert (float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)) == (pytest.approx(0.8), 0, 1.0)


def test_set_chooses_a_press_by_name_and_sets_its_fields(handed):
  assert run("--set", "cache.press=snapkv", "cache.press.window=32", "cache.press.compression_ratio=0.5") == 0
  assert handed[0]["cache_config"] == CacheConfig(press=SnapKV(compression_ratio=0.5, window=32))
  assert handed[0]["cache_config"].layout == "evict"


def test_a_press_field_the_press_lacks_is_one_error_line(handed, capsys):
  assert run("--set", "cache.press=knorm", "cache.press.window=32") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("kvjax generate: error: unknown config key 'cache.press.window'")
  assert "cache.press.compression_ratio" in err[0] and not handed


@pytest.mark.parametrize("flag", ["--temperature=--", "--top-p=--", "--max-new-tokens=--"])
def test_an_option_given_only_dashes_is_refused(handed, capsys, flag):
  # argparse alone reads `--option=--` as an empty list and calls no type check on it.
  with pytest.raises(SystemExit) as stopped:
    run(flag)
  assert stopped.value.code == 2 and not handed
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == f"kvjax generate: error: argument {flag[:-3]}: expected a value, got '--'"
