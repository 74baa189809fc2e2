"""Prefix caching in the block allocator and the request book: blocks found again by their
prefix, shared with reference counts, evicted only when no request holds them, and conserved
through any sequence of admissions, steps, preemptions, aborts and finishes."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from bulletserve.bookkeeping.book import RequestBook
from bulletserve.kv.allocator import BlockAllocator, extend_prefix_keys
from bulletserve.sched.base import SeqView

BLOCK = 4


@dataclass
class Entry:
    """A request of the book's protocol with real token ids."""

    request_id: str
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    skips_prefix_cache: bool = False
    prefix_root: int = 0
    num_cached_tokens: int = 0
    priority: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def num_output_tokens(self) -> int:
        return len(self.outputs)

    def token_ids(self, start: int, end: int) -> list[int]:
        return (self.prompt + self.outputs)[start:end]

    def view(self) -> SeqView:
        return SeqView(
            self.request_id, 0.0, self.num_tokens, self.num_computed_tokens, len(self.block_table)
        )


def _run_prompt(book: RequestBook[Entry], entry: Entry) -> None:
    """Admit the entry and compute its whole prompt in one step."""
    book.waiting.append(entry)
    book.admit((entry.request_id,))
    book.grow_blocks(entry, entry.num_tokens)
    entry.num_computed_tokens = entry.num_tokens
    book.cache_computed(entry)


def test_keys_chain_the_prefix():
    keys = extend_prefix_keys([], [1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(keys) == 2  # full blocks only
    assert extend_prefix_keys(keys[:1], [5, 6, 7, 8], BLOCK) == keys
    # The same block after another prefix has another key.
    assert extend_prefix_keys([], [0, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1] != keys[1]


def test_a_second_request_starts_from_the_first_ones_full_blocks():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(16, prefix_caching=True), BLOCK)
    first = Entry("a", list(range(10)))  # blocks [0-3], [4-7] full, [8, 9] partial
    _run_prompt(book, first)
    second = Entry("b", list(range(8)) + [50, 51, 52])
    book.waiting.append(second)
    (view,) = book.waiting_views()
    assert view.num_computed_tokens == 8 and view.num_blocks == 2  # held by "a"
    book.admit(("b",))
    assert second.block_table == first.block_table[:2] and second.num_computed_tokens == 8
    assert second.num_cached_tokens == 8
    assert (book.prefix_queries, book.prefix_hits) == (21, 8)
    # "a" finishes: the shared blocks stay with "b", the partial one is freed.
    book.finish(first)
    assert book.allocator.num_used == 2
    book.grow_blocks(second, second.num_tokens)
    assert second.block_table[2] not in first.block_table[:2]


def test_a_whole_prompt_cached_still_computes_its_last_token():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(16, prefix_caching=True), BLOCK)
    _run_prompt(book, Entry("a", list(range(8))))
    again = Entry("b", list(range(8)))
    book.waiting.append(again)
    book.admit(("b",))
    assert again.num_computed_tokens == 4  # the block holding the last token is recomputed


def test_cached_blocks_count_as_free_and_are_evicted_oldest_first():
    allocator = BlockAllocator(4, prefix_caching=True)
    book: RequestBook[Entry] = RequestBook(allocator, BLOCK)
    old, new = Entry("old", list(range(5))), Entry("new", list(range(100, 105)))
    for entry in (old, new):
        _run_prompt(book, entry)
        book.finish(entry)
    assert allocator.num_free == 4 and allocator.num_cached == 2
    allocator.allocate(3)  # two free, then the oldest cached block
    assert allocator.num_cached == 1
    probe = Entry("probe", list(range(100, 105)))
    book.waiting.append(probe)
    assert book.waiting_views()[0].num_computed_tokens == 4  # "new" survived


def test_a_cached_prefix_is_not_shared_without_prefix_caching():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(16), BLOCK)
    _run_prompt(book, Entry("a", list(range(10))))
    second = Entry("b", list(range(10)))
    book.waiting.append(second)
    assert book.waiting_views()[0].num_computed_tokens == 0
    book.admit(("b",))
    assert second.block_table == [] and book.prefix_queries == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["arrive", "admit", "step", "preempt", "abort", "finish"]),
            st.integers(0, 5),
            st.integers(0, 2),
        ),
        max_size=60,
    )
)
def test_blocks_are_conserved_and_never_lost_while_read(operations):
    """Prompts drawn from three shared prefixes. Whatever happens, every block is free, cached
    or held; a block some request holds is never handed out again; and once every request is
    gone, every block is free or cached."""
    allocator = BlockAllocator(24, prefix_caching=True)
    book: RequestBook[Entry] = RequestBook(allocator, BLOCK)
    prefixes = [list(range(p * 100, p * 100 + 9)) for p in range(3)]
    count = 0
    for action, index, prefix in operations:
        running = list(book.running)
        if action == "arrive":
            count += 1
            book.waiting.append(Entry(f"r{count}", prefixes[prefix] + [1000 + count] * index))
        elif action == "admit" and book.waiting:
            entry = book.waiting[0]
            need = -(-entry.num_tokens // BLOCK)
            if need <= allocator.num_free:
                book.admit((entry.request_id,))
                book.grow_blocks(entry, entry.num_tokens)
        elif running:
            entry = running[index % len(running)]
            if action == "step":
                if entry.num_computed_tokens == entry.num_tokens:
                    if allocator.num_free == 0:
                        continue
                    entry.outputs.append(2000 + index)
                    book.grow_blocks(entry, entry.num_tokens)
                entry.num_computed_tokens = entry.num_tokens
                book.cache_computed(entry)
            elif action == "preempt":
                book.preempt([entry.request_id])
            else:  # an abort and a finish free alike
                book.finish(entry)
        held = [b for e in book.running for b in e.block_table]
        # Every held block is in use (its count covers its holders) and not free or evictable.
        assert all(allocator._refs[b] >= held.count(b) for b in set(held))
        assert not set(held) & (set(allocator._free) | set(allocator._evictable))
        assert allocator.num_used == len(set(held))
        # What each running request holds covers what it has computed.
        for e in book.running:
            assert len(e.block_table) * BLOCK >= e.num_computed_tokens
    for entry in list(book.running) + list(book.waiting):
        book.finish(entry)
    assert allocator.num_free == allocator.num_blocks
    assert len(allocator._free) + len(allocator._evictable) == allocator.num_blocks


def test_a_waiting_requests_view_follows_evictions():
    allocator = BlockAllocator(3, prefix_caching=True)
    book: RequestBook[Entry] = RequestBook(allocator, BLOCK)
    first = Entry("a", list(range(9)))
    _run_prompt(book, first)
    book.finish(first)
    waiting = Entry("b", list(range(9)))
    book.waiting.append(waiting)
    assert book.waiting_views()[0].num_computed_tokens == 8
    allocator.allocate(2)  # the free block, then the tail of the cached prefix
    assert book.waiting_views()[0].num_computed_tokens == 4


def test_a_waiting_requests_view_finds_blocks_cached_after_it_looked():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(8, prefix_caching=True), BLOCK)
    waiting = Entry("b", list(range(9)))
    book.waiting.append(waiting)
    assert book.waiting_views()[0].num_computed_tokens == 0
    first = Entry("a", list(range(6)))  # caches the first block only
    book.waiting.appendleft(first)
    book.admit(("a",))
    book.grow_blocks(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    book.cache_computed(first)
    assert book.waiting_views()[0].num_computed_tokens == 4
    first.outputs += [6, 7]  # its second block fills
    book.grow_blocks(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    book.cache_computed(first)
    assert book.waiting_views()[0].num_computed_tokens == 8
