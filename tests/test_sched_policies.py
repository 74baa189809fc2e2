"""Property tests of the pure single-lane policies: any snapshot in, a valid plan out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bulletserve.sched.base import SchedulerSnapshot, SeqView, StepPlan, blocks_needed
from bulletserve.sched.chunked import ChunkedPolicy
from bulletserve.sched.prefill_first import PrefillFirstPolicy
from bulletserve.sched.slo import SLO

BLOCK = 16


@st.composite
def snapshots(draw) -> SchedulerSnapshot:
    def seq(index: int, running: bool) -> SeqView:
        num_tokens = draw(st.integers(1, 600))
        if running:
            computed = draw(st.integers(0, num_tokens - 1))
            blocks = -(-computed // BLOCK)
        else:
            computed, blocks = 0, 0
        lora = draw(st.sampled_from([None, "a", "b", "c"]))
        return SeqView(f"r{index}", float(index), num_tokens, computed, blocks, lora=lora)

    running = [seq(i, True) for i in range(draw(st.integers(0, 12)))]
    waiting = [seq(100 + i, False) for i in range(draw(st.integers(0, 12)))]
    return SchedulerSnapshot(
        now=1000.0,
        waiting=tuple(waiting),
        running=tuple(running),
        free_blocks=draw(st.integers(0, 200)),
        block_size=BLOCK,
        max_num_seqs=draw(st.integers(max(1, len(running)), 32)),
        max_num_batched_tokens=draw(st.integers(1, 1024)),
        max_loras=draw(st.sampled_from([None, 1, 2])),
    )


def check_common(snapshot: SchedulerSnapshot, plan: StepPlan) -> None:
    by_id = {s.request_id: s for s in snapshot.waiting + snapshot.running}
    scheduled = [s.request_id for s in plan.scheduled]
    assert len(set(scheduled)) == len(scheduled)
    assert not set(scheduled) & set(plan.preempted)
    assert set(plan.preempted) <= {s.request_id for s in snapshot.running}
    waiting_ids = [s.request_id for s in snapshot.waiting]
    # Admission is in queue order, without overtaking.
    assert list(plan.admitted) == waiting_ids[: len(plan.admitted)]
    assert set(plan.admitted) <= set(scheduled)
    running_after = len(snapshot.running) - len(plan.preempted) + len(plan.admitted)
    assert running_after <= snapshot.max_num_seqs
    freed = sum(by_id[i].num_blocks for i in plan.preempted)
    needed = sum(blocks_needed(by_id[s.request_id], s.num_tokens, BLOCK) for s in plan.scheduled)
    assert needed <= snapshot.free_blocks + freed  # admissions never exceed KV capacity
    for item in plan.scheduled:
        assert 1 <= item.num_tokens <= by_id[item.request_id].num_remaining
    # An admission brings no LoRA adapter beyond --max-loras with the running requests'.
    running_adapters = {s.lora for s in snapshot.running if s.lora is not None}
    admitted_adapters = {by_id[i].lora for i in plan.admitted if by_id[i].lora is not None}
    if snapshot.max_loras is not None and admitted_adapters - running_adapters:
        assert len(running_adapters | admitted_adapters) <= snapshot.max_loras


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.integers(1, 512))
def test_chunked_plans_are_valid(snapshot, chunk):
    plan = ChunkedPolicy(chunk).plan(snapshot)
    check_common(snapshot, plan)
    assert plan.num_tokens <= min(chunk, snapshot.max_num_batched_tokens)


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_prefill_first_never_mixes_phases(snapshot):
    plan = PrefillFirstPolicy().plan(snapshot)
    check_common(snapshot, plan)
    waiting_ids = {s.request_id for s in snapshot.waiting}
    kinds = {item.request_id in waiting_ids for item in plan.scheduled}
    assert len(kinds) <= 1
    if plan.admitted:  # whole prompts, within the budget unless a single prompt runs alone
        by_id = {s.request_id: s for s in snapshot.waiting}
        assert all(s.num_tokens == by_id[s.request_id].num_remaining for s in plan.scheduled)
        assert len(plan.scheduled) == 1 or plan.num_tokens <= snapshot.max_num_batched_tokens


def test_chunked_runs_decodes_before_new_prefills():
    running = tuple(SeqView(f"d{i}", i, 100, 99, 7) for i in range(3))
    waiting = (SeqView("w", 10.0, 500, 0, 0),)
    snapshot = SchedulerSnapshot(0.0, waiting, running, 100, BLOCK, 8, 2048)
    plan = ChunkedPolicy(64).plan(snapshot)
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [
        ("d0", 1),
        ("d1", 1),
        ("d2", 1),
        ("w", 61),
    ]


def test_out_of_blocks_preempts_the_newest_running_request():
    # Each decode crosses a block boundary and needs a new block; only one is free.
    running = tuple(SeqView(f"d{i}", i, 33, 32, 2) for i in range(3))
    snapshot = SchedulerSnapshot(0.0, (), running, 1, BLOCK, 8, 2048)
    plan = ChunkedPolicy(512).plan(snapshot)
    assert plan.preempted == ("d2",)
    assert [s.request_id for s in plan.scheduled] == ["d0", "d1"]


def test_out_of_blocks_preempts_the_lowest_priority_then_the_loosest_slo():
    """Priorities first (lower keeps its blocks), then the tightest TPOT target; among equals
    the newest goes first, as under FCFS."""
    tight, loose = SLO(1.0, 50.0), SLO(10.0, 500.0)
    running = (
        SeqView("batch-old", 0, 33, 32, 2, priority=1, slo=loose),
        SeqView("chat-loose", 1, 33, 32, 2, priority=0, slo=loose),
        SeqView("chat-tight", 2, 33, 32, 2, priority=0, slo=tight),
        SeqView("batch-new", 3, 33, 32, 2, priority=1, slo=loose),
    )
    for free, lost in ((0, ("batch-new", "batch-old")), (1, ("batch-new",))):
        snapshot = SchedulerSnapshot(0.0, (), running, free, BLOCK, 8, 2048)
        for policy in (ChunkedPolicy(512), PrefillFirstPolicy()):
            plan = policy.plan(snapshot)
            assert plan.preempted == lost
    snapshot = SchedulerSnapshot(0.0, (), running[1:3], 1, BLOCK, 8, 2048)
    assert ChunkedPolicy(512).plan(snapshot).preempted == ("chat-loose",)


def test_policies_import_without_torch():
    """Scheduling code is pure: the engine and the simulator run it as is."""
    import subprocess
    import sys

    code = (
        "import sys, bulletserve.sched, bulletserve.sched.bullet; "
        "assert 'torch' not in sys.modules, 'sched/ imported torch'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
