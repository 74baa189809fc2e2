"""The request book both executors keep: queues and KV blocks, torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from bulletserve.bookkeeping.book import RequestBook
from bulletserve.kv.allocator import BlockAllocator
from bulletserve.sched.base import SeqView

BLOCK = 4


@dataclass
class Entry:
    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    skips_prefix_cache: bool = False
    prefix_root: int = 0
    priority: int = 0

    @property
    def num_output_tokens(self) -> int:
        return 0

    def view(self) -> SeqView:
        return SeqView(self.request_id, 0.0, self.num_tokens, self.num_computed_tokens, 0)


def test_the_queue_orders_by_priority_and_preempted_requests_lead_their_priority():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(64), BLOCK)
    entries = {name: Entry(name, 4, priority=p) for name, p in (("a", 1), ("b", 0), ("c", 1))}
    entries["d"] = Entry("d", 4, priority=-1)
    for name in "abcd":
        book.enqueue(entries[name])
    assert [e.request_id for e in book.waiting] == ["d", "b", "a", "c"]
    book.admit(("d", "a"))
    book.preempt(["a", "d"])  # each back at the front of its priority
    assert [e.request_id for e in book.waiting] == ["d", "b", "a", "c"]
    book.enqueue(Entry("e", 4, priority=0))
    assert [e.request_id for e in book.waiting] == ["d", "b", "e", "a", "c"]


def test_admission_preemption_and_finishing_keep_the_queues_in_order():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(64), BLOCK)
    a, b, c = Entry("a", 10), Entry("b", 6), Entry("c", 3)
    book.waiting.extend([a, b, c])
    assert book.admit(("c", "a")) == [c, a] and list(book.waiting) == [b]
    for entry in (c, a):
        book.grow_blocks(entry, entry.num_tokens)
        entry.num_computed_tokens = entry.num_tokens
    assert (len(a.block_table), len(c.block_table)) == (3, 1)
    assert book.preempt(["a", "c"]) == [c, a]  # in running order, back at the queue's front
    assert list(book.waiting) == [c, a, b] and not book.running
    assert a.num_computed_tokens == 0 and a.num_preemptions == 1 and book.num_preemptions == 2
    assert book.allocator.num_free == 64
    book.finish(b)
    assert list(book.waiting) == [c, a]


def test_a_busy_request_keeps_its_blocks_until_its_step_ends():
    book: RequestBook[Entry] = RequestBook(BlockAllocator(8), BLOCK)
    entry = Entry("a", 8)
    book.waiting.append(entry)
    book.admit(("a",))
    book.grow_blocks(entry, 8)
    book.busy.add("a")
    book.finish(entry)  # aborted while a step writes its KV
    assert len(entry.block_table) == 2 and book.allocator.num_free == 6
    book.busy.discard("a")
    book.release_blocks(entry)  # the step's end frees them
    assert book.allocator.num_free == 8 and not entry.block_table


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("agpfb"), st.integers(0, 5)), max_size=60))
def test_any_sequence_of_operations_conserves_blocks(ops):
    book: RequestBook[Entry] = RequestBook(BlockAllocator(40), BLOCK)
    entries = [Entry(f"r{i}", 4 + 3 * i) for i in range(6)]
    book.waiting.extend(entries)
    for op, index in ops:
        entry = entries[index]
        if op == "a" and entry in book.waiting:
            book.admit((entry.request_id,))
        elif op == "g" and entry in book.running:
            need = -(-entry.num_tokens // BLOCK) - len(entry.block_table)
            if need <= book.allocator.num_free:
                book.grow_blocks(entry, entry.num_tokens)
        elif op == "p":
            book.preempt([entry.request_id])
        elif op == "f":
            book.finish(entry)
        elif op == "b":
            book.busy ^= {entry.request_id}
        held = sum(len(e.block_table) for e in entries)
        assert held + book.allocator.num_free == 40
        assert len({e.request_id for e in [*book.waiting, *book.running]}) == len(
            book.waiting
        ) + len(book.running)
    book.busy.clear()
    for entry in entries:
        book.finish(entry)
    assert book.allocator.num_free == 40
