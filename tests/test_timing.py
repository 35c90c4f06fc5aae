"""timed_alternating's schedule: one warm-up call each, then rounds that call every fn once."""

from __future__ import annotations

from kvjax.timing import timed, timed_alternating


def test_rounds_alternate_after_one_warm_up_each():
  calls = []
  fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
  times = timed_alternating(fns, repeats=3)
  assert calls == ["a", "b", "c"] * 4
  assert set(times) == {"a", "b", "c"} and all(len(t) == 3 and min(t) >= 0 for t in times.values())


def test_timed_is_the_median_of_its_repeats():
  calls = []
  assert timed(lambda: calls.append(1), repeats=5) >= 0
  assert len(calls) == 6
