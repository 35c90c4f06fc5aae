"""`kvjax bench engine_press`'s capacity part: at one pool, a press admits more long prompts at once,
and every request is served to the end on both sides."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.bench.serving.engine_press import capacity
from kvjax.cache.presses import make_press
from conftest import init_params, tiny_config


@pytest.mark.tier2  # the pressed engine's oracles (tests/serving/test_engine_press.py) are in the first tier
def test_a_press_runs_more_prompts_at_once_and_serves_them_all():
  model, params = init_params(tiny_config(2, max_len=96))
  prompts = np.random.default_rng(0).integers(0, 64, (6, 64), dtype=np.int32)
  full = capacity(model, params, prompts, 17, None, 8)  # 16 pages: three prompts of 5 pages at once
  pressed = capacity(model, params, prompts, 17, make_press("knorm", compression_ratio=0.75), 8)
  assert (full["max_running"], pressed["max_running"]) == (3, 6)
  assert full["tokens_per_s"] * full["seconds"] == pytest.approx(6 * 8)  # every token of every request
  assert pressed["requests_per_s"] * pressed["seconds"] == pytest.approx(6)
