"""Property tests for the page allocator: random interleavings of allocate (plain, or over a
cached prefix) / append / reserve / fork / free against a shadow memory that stores each
sequence's tokens through its pages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvjax.serving.allocator import OutOfPages, PageAllocator, page_digests
from kvjax.cache.layouts.paged import NULL_PAGE

NUM_PAGES = 10


class AllocatorMachine(RuleBasedStateMachine):
  """Writes every token a sequence holds into a simulated pool through its page table (applying
  the copy-on-write copies `append` asks for) and reads it back: a page handed to two writers,
  a missed copy or a page freed while in use shows up as a sequence reading the wrong tokens."""

  seqs = Bundle("seqs")

  @initialize(page_size=st.integers(1, 4))
  def setup(self, page_size):
    self.alloc = PageAllocator(NUM_PAGES, page_size)
    self.memory = np.full((NUM_PAGES, page_size), -1, np.int64)
    self.tokens: dict[int, list[int]] = {}
    self.next_id = 0
    self.next_token = 0

  def _fresh(self, count: int) -> list[int]:
    self.next_token += count
    return list(range(self.next_token - count, self.next_token))

  def _write(self, seq: int, start: int) -> None:
    pages, size = self.alloc.pages(seq), self.alloc.page_size
    for pos in range(start, len(self.tokens[seq])):
      self.memory[pages[pos // size], pos % size] = self.tokens[seq][pos]

  def _snapshot(self):
    return ({s: (self.alloc.pages(s), self.alloc.length(s)) for s in self.alloc.sequences()}, self.alloc.num_free)

  @rule(target=seqs, num_tokens=st.integers(0, 12))
  def allocate(self, num_tokens):
    seq, before = self.next_id, self._snapshot()
    self.next_id += 1
    try:
      self.alloc.allocate(seq, num_tokens)
    except OutOfPages:
      assert self._snapshot() == before
      return seq  # never created: later rules on it must fail cleanly
    self.tokens[seq] = self._fresh(num_tokens)
    self._write(seq, 0)
    return seq

  @rule(target=seqs, document=st.integers(0, 1), num_tokens=st.integers(1, 12))
  def allocate_prefixed(self, document, num_tokens):
    """A prompt opening one of two documents: its cached pages shared (they must already read as
    its tokens), the rest written, then its whole pages entered in the cache."""
    seq, before = self.next_id, self._snapshot()
    self.next_id += 1
    tokens = [10_000 * (document + 1) + i for i in range(num_tokens)]
    digests = page_digests(tokens, self.alloc.page_size)
    shared = len(self.alloc.prefix(digests))
    try:
      self.alloc.allocate(seq, num_tokens, prefix=digests)
    except OutOfPages:
      assert self._snapshot() == before
      return seq
    self.tokens[seq] = tokens
    self._write(seq, shared * self.alloc.page_size)
    self.alloc.cache(seq, digests)
    return seq

  @rule(seq=seqs, num_tokens=st.integers(1, 6))
  def append(self, seq, num_tokens):
    if seq not in self.tokens:
      with pytest.raises(KeyError):
        self.alloc.append(seq, num_tokens)
      return
    before = self._snapshot()
    try:
      copies = self.alloc.append(seq, num_tokens)
    except OutOfPages:
      assert self._snapshot() == before
      return
    for src, dst in copies:
      assert self.alloc.refcount(dst) == 1 and src != dst
      self.memory[dst] = self.memory[src]
    start = len(self.tokens[seq])
    self.tokens[seq] += self._fresh(num_tokens)
    self._write(seq, start)

  @rule(seq=seqs, extra=st.integers(0, 9))
  def reserve(self, seq, extra):
    if seq not in self.tokens:
      return
    before = self._snapshot()
    try:
      self.alloc.reserve(seq, len(self.tokens[seq]) + extra)
    except OutOfPages:
      assert self._snapshot() == before
      return
    assert self.alloc.capacity(seq) >= len(self.tokens[seq]) + extra

  @rule(target=seqs, parent=seqs)
  def fork(self, parent):
    child = self.next_id
    self.next_id += 1
    if parent not in self.tokens:
      return child
    free = self.alloc.num_free
    self.alloc.fork(parent, child)
    assert self.alloc.num_free == free  # sharing costs no pages
    self.tokens[child] = list(self.tokens[parent])
    return child

  @rule(seq=consumes(seqs))
  def free(self, seq):
    if seq not in self.tokens:
      with pytest.raises(KeyError):
        self.alloc.free(seq)
      return
    self.alloc.free(seq)
    del self.tokens[seq]

  @invariant()
  def consistent(self):
    if not hasattr(self, "alloc"):
      return
    self.alloc.check()
    self.fewest = min(getattr(self, "fewest", self.alloc.num_usable), self.alloc.num_free)
    assert self.alloc.fewest_free == self.fewest  # the low-water mark, seen after every rule
    size = self.alloc.page_size
    for seq, tokens in self.tokens.items():
      pages = self.alloc.pages(seq)
      assert NULL_PAGE not in pages
      read = [self.memory[pages[pos // size], pos % size] for pos in range(len(tokens))]
      assert read == tokens, f"sequence {seq} reads {read}, wrote {tokens}"
    held = {p for s in self.tokens for p in self.alloc.pages(s)}
    assert self.alloc.num_free == self.alloc.num_usable - len(held)

  def teardown(self):
    if not hasattr(self, "alloc"):
      return
    for seq in list(self.tokens):
      self.alloc.free(seq)
    self.alloc.check()
    assert self.alloc.num_free == self.alloc.num_usable
    assert not self.alloc.sequences()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_cached_pages_nobody_holds_are_reused_last_and_oldest_first():
  alloc = PageAllocator(7, 2)  # 6 usable pages of 2 tokens
  document = np.arange(8)
  digests = page_digests(document, 2)
  alloc.allocate("a", 8, prefix=digests)
  alloc.cache("a", digests)
  first = alloc.pages("a")
  alloc.free("a")
  assert alloc.num_free == 6 and alloc.num_cached == 4  # freed, still cached
  alloc.allocate("b", 7, prefix=page_digests(document[:7], 2))  # 3 whole pages shared, 1 fresh
  assert alloc.pages("b")[:3] == first[:3] and alloc.pages("b")[3] not in first
  alloc.allocate("c", 4)  # the 2 plain free pages, then the one idle cached page
  assert set(alloc.pages("c")) >= {first[3]} and alloc.num_cached == 3
  alloc.check()
  with pytest.raises(OutOfPages, match="need 1 free pages, 0 of 6 are free"):
    alloc.allocate("d", 1)


def test_null_page_is_never_handed_out():
  alloc = PageAllocator(5, 2)
  pages = alloc.allocate("a", 8)
  assert sorted(pages) == [1, 2, 3, 4]
  with pytest.raises(OutOfPages, match="need 1 free pages, 0 of 4 are free"):
    alloc.append("a")
  alloc.free("a")
  assert alloc.num_free == 4


def test_page_table_pads_with_null_page():
  alloc = PageAllocator(8, 4)
  alloc.allocate("a", 5)
  alloc.allocate("b", 1)
  table = alloc.page_table(["a", None, "b"], 3)
  np.testing.assert_array_equal(table, [[1, 2, 0], [0, 0, 0], [3, 0, 0]])
  with pytest.raises(ValueError, match="holds 2 pages, more than the page table's width of 1"):
    alloc.page_table(["a"], 1)


def test_fork_shares_written_pages_only_and_copies_on_write():
  alloc = PageAllocator(10, 4)
  alloc.allocate("p", 6)
  alloc.reserve("p", 12)  # a third, unwritten page stays private to the parent
  child = alloc.fork("p", "c")
  assert child == alloc.pages("p")[:2] and [alloc.refcount(p) for p in child] == [2, 2]
  copies = alloc.append("c", 3)  # positions 6..8: the shared, half-written page is copied
  assert copies == [(child[1], alloc.pages("c")[1])]
  assert alloc.refcount(child[1]) == 1 and alloc.pages("c")[0] == child[0]
  assert alloc.append("p", 2) == []  # the parent now holds its page alone: written in place
  alloc.check()


def test_bad_requests_name_the_problem():
  alloc = PageAllocator(4, 2)
  alloc.allocate("a", 1)
  with pytest.raises(ValueError, match="sequence 'a' already exists"):
    alloc.allocate("a", 1)
  with pytest.raises(ValueError, match="num_tokens must be an integer >= 1"):
    alloc.append("a", 0)
  with pytest.raises(KeyError, match="unknown sequence 'z'"):
    alloc.free("z")
  with pytest.raises(ValueError, match="page_size must be a positive integer"):
    PageAllocator(4, 0)
  with pytest.raises(ValueError, match="leaves no page besides the reserved null page"):
    PageAllocator(1, 4)
