"""Host-side page allocator for the paged KV cache: free list, reference counts, page tables.

A sequence owns an ordered list of pages; page j holds its positions [j*Z, (j+1)*Z) for page
size Z. Pages are reference counted so that `fork` can share a prefix between sequences
(parallel sampling): a shared page is never written, and the first write into a shared page
copies it first (copy on write; the copy itself is done on the device by
PagedCache.copy_pages from the (src, dst) pairs `append` returns).

Page 0 is the null page (kvjax.cache.pages.NULL_PAGE): never handed out, never freed.

Prefix caching: a page that holds a whole page of a prompt is entered under the digest of the
prompt up to the end of that page (`page_digests`: sha256 chained page by page, so a digest names
the whole prefix, not only the page's own tokens). A later sequence whose prompt opens with the
same tokens starts holding those pages (`allocate(..., prefix=digests)`) and computes only the
rest. A cached page that no sequence holds stays cached and counts as free; it is handed out
again, and forgotten by the cache, only once no plain free page is left, least recently freed first.

Every operation either succeeds or raises before changing anything, so a failed request
(OutOfPages, an unknown sequence) leaves the allocator exactly as it was.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np

from kvjax.cache.pages import NULL_PAGE
from kvjax.fields import check_positive_int


def page_digests(tokens, page_size: int) -> list[bytes]:
  """The digest of each whole page of `tokens` (int[L]): entry j names tokens[: (j + 1) * page_size]."""
  tokens = np.asarray(tokens, np.int64)
  digests, digest = [], b""
  for j in range(len(tokens) // page_size):
    digest = hashlib.sha256(digest + tokens[j * page_size : (j + 1) * page_size].tobytes()).digest()
    digests.append(digest)
  return digests


class OutOfPages(RuntimeError):
  """Too few free pages for a request right now; free or preempt a sequence and retry."""


class PageAllocator:
  """Allocates pages 1 .. num_pages - 1 of a pool of `num_pages` pages of `page_size` tokens."""

  def __init__(self, num_pages: int, page_size: int):
    check_positive_int(num_pages, "num_pages")
    check_positive_int(page_size, "page_size")
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages} leaves no page besides the reserved null page")
    self.num_pages = num_pages
    self.page_size = page_size
    self._refcount = np.zeros(num_pages, np.int64)
    # Popped from the end: low page ids are handed out first, which keeps runs reproducible.
    self._free = list(range(num_pages - 1, NULL_PAGE, -1))
    self._pages: dict[Hashable, list[int]] = {}
    self._lengths: dict[Hashable, int] = {}
    self._cached: dict[bytes, int] = {}  # prefix digest -> page
    self._digest: dict[int, bytes] = {}  # page -> its prefix digest
    self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no sequence holds, oldest first
    self.fewest_free = self.num_free  # the low-water mark of num_free since the pool was made

  # Queries.

  @property
  def num_free(self) -> int:
    """Pages a sequence can take: the free ones and the cached ones nobody holds."""
    return len(self._free) + len(self._idle)

  @property
  def num_cached(self) -> int:
    return len(self._cached)

  def prefix(self, digests: Iterable[bytes]) -> list[int]:
    """The cached pages of the leading `digests` (page_digests of a prompt), up to the first one
    not cached."""
    pages = []
    for digest in digests:
      page = self._cached.get(digest)
      if page is None:
        break
      pages.append(page)
    return pages

  @property
  def num_usable(self) -> int:
    """Pages a sequence could ever hold: all but the null page."""
    return self.num_pages - 1

  def pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  def __contains__(self, seq_id: Hashable) -> bool:
    return seq_id in self._pages

  def sequences(self) -> list[Hashable]:
    return list(self._pages)

  def pages(self, seq_id: Hashable) -> tuple[int, ...]:
    return tuple(self._pages[self._known(seq_id)])

  def length(self, seq_id: Hashable) -> int:
    """Tokens written to the sequence."""
    return self._lengths[self._known(seq_id)]

  def capacity(self, seq_id: Hashable) -> int:
    """Tokens the sequence's pages hold, written or not."""
    return len(self._pages[self._known(seq_id)]) * self.page_size

  def refcount(self, page: int) -> int:
    return int(self._refcount[page])

  def page_table(self, seq_ids: Iterable[Hashable | None], width: int) -> np.ndarray:
    """int32[len(seq_ids), width]: row i lists seq_ids[i]'s pages, padded with the null page.
    A None entry is an idle row (all null pages)."""
    seq_ids = list(seq_ids)
    table = np.full((len(seq_ids), width), NULL_PAGE, np.int32)
    for row, seq_id in enumerate(seq_ids):
      if seq_id is None:
        continue
      pages = self._pages[self._known(seq_id)]
      if len(pages) > width:
        raise ValueError(f"sequence {seq_id!r} holds {len(pages)} pages, more than the page table's width of {width}")
      table[row, : len(pages)] = pages
    return table

  # Operations.

  def allocate(self, seq_id: Hashable, num_tokens: int, prefix: Iterable[bytes] = ()) -> tuple[int, ...]:
    """Starts sequence `seq_id` holding num_tokens tokens; returns its pages. Its first pages are
    the cached pages of the leading `prefix` digests (self.prefix), shared, the rest fresh."""
    if seq_id in self._pages:
      raise ValueError(f"sequence {seq_id!r} already exists")
    self._check_count("num_tokens", num_tokens, minimum=0)
    shared = self.prefix(prefix)[: self.pages_for(num_tokens)]
    idle = [page for page in shared if page in self._idle]
    fresh = self.pages_for(num_tokens) - len(shared)
    if fresh > self.num_free - len(idle):
      raise OutOfPages(f"need {fresh} free pages, {self.num_free - len(idle)} of {self.num_usable} are free")
    for page in shared:
      self._idle.pop(page, None)
      self._refcount[page] += 1
    self._pages[seq_id] = shared + self._take(fresh)
    self._lengths[seq_id] = num_tokens
    return tuple(self._pages[seq_id])

  def cache(self, seq_id: Hashable, digests: Iterable[bytes]) -> None:
    """Enters the sequence's first pages in the prefix cache under `digests` (page_digests of the
    tokens written there). A digest already cached, or a page already entered, is left as it is."""
    pages = self._pages[self._known(seq_id)]
    for page, digest in zip(pages, digests):
      if digest not in self._cached and page not in self._digest:
        self._cached[digest], self._digest[page] = page, digest

  def reserve(self, seq_id: Hashable, capacity: int) -> tuple[int, ...]:
    """Grows the sequence's pages to hold at least `capacity` tokens without writing any
    (preallocation policies: a doubling buffer, max-length reservation). Returns the new pages."""
    self._check_count("capacity", capacity, minimum=0)
    pages = self._pages[self._known(seq_id)]
    new = self._take(max(0, self.pages_for(capacity) - len(pages)))
    pages.extend(new)
    return tuple(new)

  def append(self, seq_id: Hashable, num_tokens: int = 1) -> list[tuple[int, int]]:
    """Extends the sequence by num_tokens tokens, allocating pages as needed.

    Returns the (src, dst) page copies the device must make before writing: a shared page that
    is about to be written is replaced by a private copy (copy on write).
    """
    self._check_count("num_tokens", num_tokens, minimum=1)
    pages = self._pages[self._known(seq_id)]
    length = self._lengths[seq_id]
    first, last = length // self.page_size, (length + num_tokens - 1) // self.page_size
    shared = [j for j in range(first, min(last + 1, len(pages))) if self._refcount[pages[j]] > 1]
    growth = max(0, last + 1 - len(pages))
    fresh = self._take(len(shared) + growth)
    copies = []
    for j, page in zip(shared, fresh):
      self._refcount[pages[j]] -= 1
      # Positions before `length` in the shared page hold data; later ones are still unwritten.
      if j * self.page_size < length:
        copies.append((pages[j], page))
      pages[j] = page
    pages.extend(fresh[len(shared) :])
    self._lengths[seq_id] = length + num_tokens
    return copies

  def fork(self, parent: Hashable, child: Hashable) -> tuple[int, ...]:
    """Starts `child` sharing the pages that hold the parent's tokens (its reserved, unwritten
    pages stay private). Returns the child's pages."""
    if child in self._pages:
      raise ValueError(f"sequence {child!r} already exists")
    length = self._lengths[self._known(parent)]
    shared = self._pages[parent][: self.pages_for(length)]
    for page in shared:
      self._refcount[page] += 1
    self._pages[child] = list(shared)
    self._lengths[child] = length
    return tuple(shared)

  def free(self, seq_id: Hashable) -> None:
    """Drops the sequence; pages nobody else holds return to the free list."""
    for page in reversed(self._pages.pop(self._known(seq_id))):
      self._refcount[page] -= 1
      if self._refcount[page] == 0:
        if page in self._digest:
          self._idle[page] = None
        else:
          self._free.append(page)
    del self._lengths[seq_id]

  def check(self) -> None:
    """Verifies the bookkeeping; raises AssertionError describing the first inconsistency."""
    counts = np.zeros(self.num_pages, np.int64)
    for seq_id, pages in self._pages.items():
      assert len(set(pages)) == len(pages), f"sequence {seq_id!r} holds a page twice: {pages}"
      assert NULL_PAGE not in pages, f"sequence {seq_id!r} holds the null page"
      assert len(pages) >= self.pages_for(self._lengths[seq_id]), (
        f"sequence {seq_id!r} has {self._lengths[seq_id]} tokens in only {len(pages)} pages"
      )
      np.add.at(counts, pages, 1)
    assert (counts == self._refcount).all(), (
      f"reference counts disagree with holders at pages {np.flatnonzero(counts != self._refcount)}"
    )
    free = set(self._free)
    assert len(free) == len(self._free), "a page is on the free list twice"
    assert NULL_PAGE not in free, "the null page is on the free list"
    unheld = set(np.flatnonzero(self._refcount == 0).tolist()) - {NULL_PAGE}
    assert not free & set(self._idle), "a page is both free and cached"
    assert free | set(self._idle) == unheld, (
      f"free and idle pages differ from the unreferenced: {sorted((free | set(self._idle)) ^ unheld)}"
    )
    assert all(page in self._digest for page in self._idle), "an idle page is not in the prefix cache"
    assert {p: d for d, p in self._cached.items()} == self._digest, "the prefix cache's two maps disagree"

  # Internals.

  def _known(self, seq_id: Hashable) -> Hashable:
    if seq_id not in self._pages:
      raise KeyError(f"unknown sequence {seq_id!r}")
    return seq_id

  def _check_count(self, name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
      raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

  def _take(self, count: int) -> list[int]:
    if count > self.num_free:
      raise OutOfPages(f"need {count} free pages, {self.num_free} of {self.num_usable} are free")
    taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
    while len(taken) < count:  # then the cached pages nobody holds, least recently freed first
      page, _ = self._idle.popitem(last=False)
      del self._cached[self._digest.pop(page)]
      taken.append(page)
    for page in taken:
      assert self._refcount[page] == 0, f"page {page} on the free list is still referenced"
      self._refcount[page] = 1
    self.fewest_free = min(self.fewest_free, self.num_free)
    return taken
