"""Property tests of Bullet's pure scheduler on a GPU preset (132 SMs in groups of 8) and a
2-thread CPU."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bulletserve.model.presets import PRESETS
from bulletserve.perf.hardware import load_preset
from bulletserve.perf.model import PerfModel
from bulletserve.sched.base import SeqView
from bulletserve.sched.bullet import (
    RULE_NAMES,
    RULES,
    BulletParams,
    BulletPolicy,
    BulletSnapshot,
    LatencyStats,
    LatencyWindow,
    PrefillInFlight,
    Split,
    UnitSpace,
)
from bulletserve.sched.bullet.types import MODEL_ERROR_STEPS
from bulletserve.sched.slo import SLO

H100 = load_preset("h100-sxm")
CPU = dataclasses.replace(
    H100,
    name="cpu-2",
    kind="cpu",
    units=2,
    unit_granularity=1,
    min_units=1,
    bandwidth_saturation_units=1,
    gemm_tile=None,
)
BLOCK = 16
CHUNK_GRANULE = BulletParams().chunk_granule


def make_policy(
    hw, layers_per_step=None, partition="auto", static=None, min_remainder=None, fuse=True
) -> BulletPolicy:
    cfg = PRESETS["llama-3.1-8b"]
    return BulletPolicy(
        perf=PerfModel(cfg, hw, "bfloat16"),
        units=UnitSpace(hw.units, hw.unit_granularity, hw.min_units, min_remainder),
        num_layers=cfg.num_layers,
        slo=SLO(3.0, 150.0),
        layers_per_step=layers_per_step,
        partition=partition,
        static_split=static,
        fuse_decode=fuse,
    )


POLICIES = {
    "h100": make_policy(H100),
    "h100-no-fuse": make_policy(H100, fuse=False),
    "h100-groups": make_policy(H100, layers_per_step=8),
    # Remainders of fewer than 24 SMs refused, as on a Hopper GPU (GreenContextSMs).
    "h100-remainder": make_policy(H100, min_remainder=24),
    "cpu": make_policy(CPU),
    "cpu-no-fuse": make_policy(CPU, fuse=False),
    "cpu-groups": make_policy(CPU, layers_per_step=8),
}


@st.composite
def snapshots(draw, hw) -> BulletSnapshot:
    now = 100.0

    def seq(index: int, computed: bool) -> SeqView:
        tokens = draw(st.integers(1, 4000))
        arrival = now - draw(st.floats(0, 30))
        blocks = -(-tokens // BLOCK) if computed else 0
        return SeqView(f"r{index}", arrival, tokens, tokens - 1 if computed else 0, blocks)

    waiting = tuple(seq(i, False) for i in range(draw(st.integers(0, 10))))
    decoding = tuple(seq(100 + i, True) for i in range(draw(st.integers(0, 10))))
    prefill = None
    if draw(st.booleans()):
        batch = tuple(seq(200 + i, False) for i in range(draw(st.integers(1, 3))))
        layers_done = draw(st.integers(0, 31))
        if len(batch) == 1 and layers_done == 0:  # a prompt between its chunks
            first = batch[0]
            done = draw(st.integers(0, first.num_tokens - 1))
            batch = (dataclasses.replace(first, num_computed_tokens=done),)
        prefill = PrefillInFlight(batch, layers_done, draw(st.booleans()))
    ttft = draw(st.none() | st.floats(0.05, 3.0))  # P90 TTFT over its SLO
    tpot = draw(st.none() | st.floats(0.05, 3.0))  # P90 TPOT over its SLO
    counts = UnitSpace(hw.units, hw.unit_granularity, hw.min_units).counts()
    current = draw(st.sampled_from(counts))
    return BulletSnapshot(
        now=now,
        waiting=waiting,
        prefill=prefill,
        decoding=decoding,
        free_blocks=draw(st.integers(0, 2000)),
        block_size=BLOCK,
        max_num_seqs=draw(st.integers(len(decoding) + 1, 64)),
        max_prefill_tokens=draw(st.integers(1, 16384)),
        stats=LatencyStats(ttft, tpot),
        split=Split(hw.units - current, current, "decode-fewest"),
    )


def check_split(policy: BulletPolicy, split: Split) -> None:
    units = policy.units
    assert units.is_valid(split.prefill) and units.is_valid(split.decode)
    assert split.prefill + split.decode <= units.total or split.rule == "none"
    assert split.rule in RULE_NAMES


@pytest.mark.parametrize("name", list(POLICIES))
def test_plans_are_valid(name):
    policy = POLICIES[name]
    hw = H100 if name.startswith("h100") else CPU

    @settings(max_examples=150, deadline=None)
    @given(snapshots(hw))
    def check(snap: BulletSnapshot) -> None:
        prefill_plan = policy.plan_prefill(snap)
        decode_plan = policy.plan_decode(snap)
        check_split(policy, prefill_plan.split)
        check_split(policy, decode_plan.split)
        step = prefill_plan.prefill
        if step is not None:
            assert 0 <= step.layer_start < step.layer_end <= policy.num_layers
            if step.admitted:
                assert snap.prefill is None
                admitted = [s for s in snap.waiting if s.request_id in step.admitted]
                # Admissions never exceed KV capacity.
                need = sum(-(-s.num_tokens // BLOCK) for s in admitted)
                assert need <= snap.free_blocks
                assert len(admitted) + len(snap.decoding) <= snap.max_num_seqs
                # An at-risk request that can still make its deadline is never passed over by
                # one that is not at risk (one past its deadline waits behind both).
                est = policy.estimator()
                risky = [
                    s
                    for s in snap.waiting
                    if est.at_risk(s, snap.now) and not est.past_deadline(s, snap.now)
                ]
                if risky:
                    assert any(est.at_risk(s, snap.now) for s in admitted)
                    passed = [s for s in risky if s.request_id not in step.admitted]
                    assert all(est.at_risk(s, snap.now) for s in admitted) or not passed
        total = policy.units.total
        batch = snap.prefill.requests if snap.prefill else ()
        if step is not None and step.admitted:
            batch = tuple(s for s in snap.waiting if s.request_id in step.admitted)
        if policy.partition == "auto" and any(
            policy.estimator().at_risk(s, snap.now) for s in batch
        ):
            # An at-risk prompt is never starved: its lane keeps units whatever TPOT does.
            assert prefill_plan.split.prefill > 0 and decode_plan.split.prefill > 0
        if prefill_plan.prefill is None and snap.decoding:  # nothing can prefill
            assert prefill_plan.split == decode_plan.split == Split(0, total, "no-prefill")
        if not snap.decoding and prefill_plan.prefill is not None:
            assert prefill_plan.split == decode_plan.split == Split(total, 0, "no-decode")
        if step is not None and step.decode:
            # Decode rows ride only in a step that runs all layers of a pass no step has begun,
            # carrying every decoding request, with KV for the prompts and the rows; a chunk
            # only of a batch's one prompt, short of its rest.
            assert prefill_plan.split.rule in ("fused", "fused-ttft-first", "chunked-plan")
            assert (prefill_plan.split.prefill, prefill_plan.split.decode) == (total, 0)
            assert (step.layer_start, step.layer_end) == (0, policy.num_layers)
            in_flight = snap.prefill
            assert in_flight is None or (in_flight.layers_done == 0 and not in_flight.stepping)
            assert bool(step.admitted) == (in_flight is None)
            prompts = in_flight.requests if in_flight else batch
            if step.chunk is not None:
                assert len(prompts) == 1 and step.chunk % CHUNK_GRANULE == 0
                assert 0 < step.chunk < prompts[0].num_remaining
            assert [s.request_id for s in step.decode] == [s.request_id for s in snap.decoding]
            need = sum(
                -(-s.num_tokens // BLOCK) for s in snap.waiting if s.request_id in step.admitted
            )
            need += sum(-(-s.num_tokens // BLOCK) - s.num_blocks for s in snap.decoding)
            assert need <= snap.free_blocks
        else:
            assert prefill_plan.split.rule not in ("fused", "fused-ttft-first", "chunked-plan")
        scheduled = {s.request_id for s in decode_plan.decode}
        assert scheduled.isdisjoint(decode_plan.preempted)
        assert scheduled | set(decode_plan.preempted) == {s.request_id for s in snap.decoding}

    check()


def test_at_risk_request_goes_first_and_short_ones_otherwise():
    policy = POLICIES["h100"]
    fresh_long = SeqView("long", 99.99, 3000, 0, 0)
    fresh_short = SeqView("short", 99.99, 100, 0, 0)
    late = SeqView("late", 95.0, 2000, 0, 0)  # waited 5 s on a 6 s budget
    snap = BulletSnapshot(
        100.0,
        (fresh_long, fresh_short, late),
        None,
        (),
        10_000,
        BLOCK,
        64,
        16384,
        LatencyStats(),
        Split(0, 132, "no-prefill"),
    )
    assert [s.request_id for s in policy.order_waiting(snap)] == ["late", "short", "long"]
    assert policy.plan_prefill(snap).prefill.admitted[0] == "late"


def test_a_cached_prompt_is_judged_on_its_whole_prompts_budget_and_its_uncached_work():
    estimator = POLICIES["h100"].estimator()
    slo_s = estimator.slo.ttft_s(2000)  # the 2,000-token prompt's TTFT budget
    waited = 0.6 * slo_s  # past a 200-token prompt's budget, within its own
    fresh = SeqView("fresh", 100.0 - waited, 2000, 0, 0)
    cached = SeqView("cached", 100.0 - waited, 2000, 1792, 112)  # all but 208 tokens cached
    assert estimator.slo.ttft_s(208) < waited
    assert estimator.at_risk(fresh, 100.0) == (
        waited + estimator.prefill_s(2000) >= estimator.params.risk_share * slo_s
    )
    assert not estimator.at_risk(cached, 100.0)
    assert estimator.prefill_s(208, 1792) < estimator.prefill_s(2000)


def test_decode_gets_fewest_units_that_keep_tpot_and_do_not_outlast_the_prefill():
    from bulletserve.perf.execution_state import ExecutionState

    policy = POLICIES["h100-no-fuse"]
    decoding = tuple(SeqView(f"d{i}", 0.0, 1000, 999, 63) for i in range(32))
    budget = 0.15 * 0.8
    ctx = tuple(s.num_tokens for s in decoding)

    def predict(prompt: int, decode_units: int):
        es = ExecutionState((prompt,), (0,), 132 - decode_units, ctx + (prompt + 1,), decode_units)
        return policy.perf.predict(es)

    for prompt in (2000, 64):  # a long prefill, and one much shorter than the decode step
        waiting = (SeqView("w", 99.9, prompt, 0, 0),)
        stats = LatencyStats(1e-3, 0.05 / 0.15)
        snap = BulletSnapshot(
            100.0,
            waiting,
            None,
            decoding,
            10_000,
            BLOCK,
            64,
            16384,
            stats,
            Split(66, 66, "decode-fewest"),
        )
        split = policy.plan_prefill(snap).split
        assert 0 < split.decode < 132 and split.prefill == 132 - split.decode
        chosen = predict(prompt, split.decode)
        assert chosen.decode_s <= budget and chosen.decode_s <= chosen.prefill_s
        if split.decode - 8 >= 8:  # one granule less keeps TPOT no more, or outlasts prefill
            fewer = predict(prompt, split.decode - 8)
            assert fewer.decode_s > budget or fewer.decode_s > fewer.prefill_s
        keeps_tpot = min(d for d in range(8, 132, 8) if predict(prompt, d).decode_s <= budget)
        if prompt == 64:  # the short prefill: decode gets more than TPOT alone asks for
            assert split.decode > keeps_tpot


def test_cpu_time_slices_where_co_running_is_zero_sum():
    """With fusing off (the next tests too; fusing is tested on its own below): on a CPU
    whose threads split compute and bandwidth evenly, co-running is zero-sum: the
    lanes take turns on every thread, a prefill first, at risk or not and however long,
    whether the window's P90 TPOT holds or not. Where one thread already has all of the
    bandwidth, a decode step beside the prefill gains: the two share the CPU, decode on the
    fewest threads while P90 TPOT holds, half each once TPOT and TTFT both miss; on a GPU the
    same (not at risk) prefill shares the device."""
    decoding = tuple(SeqView(f"d{i}", 0.0, 300, 299, 19) for i in range(4))

    def snap(
        total: int, prompt: int, p90_tpot_s: float, waited_s: float = 0.01, p90_ttft: float = 0.5
    ) -> BulletSnapshot:
        waiting = (SeqView("w", 100.0 - waited_s, prompt, 0, 0),)
        half = Split(total // 2, total // 2, "balance")
        stats = LatencyStats(p90_ttft, p90_tpot_s / 0.15)
        return BulletSnapshot(100.0, waiting, None, decoding, 10_000, BLOCK, 64, 16384, stats, half)

    zero_sum = make_policy(dataclasses.replace(CPU, bandwidth_saturation_units=2), fuse=False)
    assert not zero_sum.estimator().at_risk(SeqView("w", 99.99, 64, 0, 0), 100.0)
    assert zero_sum.plan_prefill(snap(2, 64, 0.05)).split == Split(2, 0, "turns")
    assert zero_sum.plan_prefill(snap(2, 2000, 0.05)).split == Split(2, 0, "turns")
    assert zero_sum.plan_decode(snap(2, 2000, 0.05)).split == Split(2, 0, "turns")
    # TPOT over its SLO, TTFT missing or not: still turns, never the even split (the worst
    # of the three here).
    assert zero_sum.plan_prefill(snap(2, 64, 0.2)).split == Split(2, 0, "turns")
    assert zero_sum.plan_decode(snap(2, 64, 0.2)).split == Split(2, 0, "turns")
    assert zero_sum.plan_decode(snap(2, 64, 0.2, p90_ttft=1.5)).split == Split(2, 0, "turns")
    assert zero_sum.plan_prefill(snap(2, 64, 0.2)).split.rule == "turns"
    shares = POLICIES["cpu-no-fuse"].plan_prefill(snap(2, 64, 0.05)).split
    assert shares == Split(1, 1, "decode-fewest")
    both_missing = POLICIES["cpu-no-fuse"].plan_prefill(snap(2, 64, 0.2, p90_ttft=1.5)).split
    assert both_missing == Split(1, 1, "balance")
    assert POLICIES["h100-no-fuse"].plan_prefill(snap(132, 64, 0.05)).split.decode > 0


def test_cpu_shares_by_each_lane_s_share_of_its_speed_not_by_the_longer_step():
    """A long prefill beside short decode steps: the prefill on one thread outlasts the prefill
    and a decode step one after the other on both, but the decode lane keeps stepping beside
    it, so the lanes do more work per second side by side than taking turns."""
    from bulletserve.perf.execution_state import ExecutionState

    policy = POLICIES["cpu-no-fuse"]
    decoding = tuple(SeqView(f"d{i}", 0.0, 300, 299, 19) for i in range(4))
    ctx = tuple(s.num_tokens for s in decoding) + (1025,)
    prefill_alone, decode_alone = policy.estimator().alone_s((1024,), (), ctx, policy.num_layers)
    side = policy.perf.predict(
        ExecutionState(prefill_lens=(1024,), prefill_units=1, decode_ctx=ctx, decode_units=1)
    )
    assert side.step_s > prefill_alone + decode_alone
    assert prefill_alone / side.prefill_s + decode_alone / side.decode_s > 1
    waiting = (SeqView("w", 100.0, 1024, 0, 0),)
    snap = BulletSnapshot(
        100.0, waiting, None, decoding, 10_000, BLOCK, 64, 16384, LatencyStats(0.5, 0.05 / 0.15),
        Split(2, 0, "turns"),
    )  # fmt: skip
    assert policy.plan_prefill(snap).split == Split(1, 1, "decode-fewest")


def test_cpu_co_runs_only_a_prompt_that_keeps_its_ttft_margin_at_the_slower_speed():
    """Where co-running gains, a prompt that would reach the at-risk share of its TTFT budget
    at the side-by-side speed (though not at the full-CPU speed that `at_risk` assumes) gets
    every thread instead."""
    from bulletserve.perf.execution_state import ExecutionState

    policy = POLICIES["cpu-no-fuse"]
    decoding = tuple(SeqView(f"d{i}", 0.0, 300, 299, 19) for i in range(4))
    ctx = tuple(s.num_tokens for s in decoding) + (257,)
    full = policy.perf.predict(ExecutionState(prefill_lens=(256,), prefill_units=2)).prefill_s
    side = policy.perf.predict(
        ExecutionState(prefill_lens=(256,), prefill_units=1, decode_ctx=ctx, decode_units=1)
    ).prefill_s
    assert side > full
    waited = 0.7 * policy.slo.ttft_s(256) - (full + side) / 2

    def snap(waited_s: float) -> BulletSnapshot:
        waiting = (SeqView("w", 100.0 - waited_s, 256, 0, 0),)
        stats = LatencyStats(1.5, 0.2 / 0.15)  # TTFT and TPOT both missing: the lanes would share
        return BulletSnapshot(
            100.0,
            waiting,
            None,
            decoding,
            10_000,
            BLOCK,
            64,
            16384,
            stats,
            Split(1, 1, "decode-fewest"),
        )

    assert not policy.estimator().at_risk(snap(waited).waiting[0], 100.0)
    assert policy.plan_prefill(snap(0.0)).split == Split(1, 1, "balance")
    assert policy.plan_prefill(snap(waited)).split == Split(2, 0, "turns")


def test_cpu_fuses_the_decode_rows_into_a_prefill_step_where_that_does_most_work():
    """A short prompt beside a decode batch on a CPU where co-running is zero-sum: one step of
    both on every thread costs about the prefill alone (the rows ride in its GEMMs), less than
    the two one after the other, so the prefill step carries every decoding request and the
    decode lane pauses. Where sharing the threads does more work a second (each lane at full
    speed on one thread), the lanes share. Not where the step cannot carry the rows: a layer
    group short of the last layer, a prefill step running or between its layer groups, fusing
    turned off, or a fixed split."""
    from bulletserve.perf.execution_state import fused_step_state

    zero_sum = dataclasses.replace(CPU, bandwidth_saturation_units=2)
    policy = make_policy(zero_sum)
    # Contexts of 320 tokens fill their 20 blocks: each row's next token needs a new block.
    decoding = tuple(SeqView(f"d{i}", 0.0, 321, 320, 20) for i in range(8))
    waiting = (SeqView("w", 100.0, 64, 0, 0),)

    def snap(free_blocks: int = 10_000, prefill=None) -> BulletSnapshot:
        # TPOT over its SLO while TTFT holds: where the lanes take turns, the policy sizes
        # steps itself only then (else it runs chunked prefill's plan, rule chunked-plan).
        stats = LatencyStats(0.5, 0.2 / 0.15)
        queue = () if prefill else waiting
        return BulletSnapshot(
            100.0,
            queue,
            prefill,
            decoding,
            free_blocks,
            BLOCK,
            64,
            16384,
            stats,
            Split(2, 0, "turns"),
        )

    prefill_alone, decode_alone = policy.estimator().alone_s(
        (64,), (), (321,) * 8, policy.num_layers
    )
    fused, _ = fused_step_state([(64, 0)], [321] * 8, 2)
    fused_s = policy.perf.predict(fused).prefill_s
    assert prefill_alone < fused_s < prefill_alone + decode_alone
    fusion = policy.situation(snap(), waiting, policy.plan_prefill(snap()).prefill, True).fusion
    assert fusion.gain == pytest.approx((prefill_alone + decode_alone) / fused_s)
    assert fusion.seconds == fused_s and fusion.chunk is None and fusion.gain > 1.0
    plan = policy.plan_prefill(snap())
    assert plan.split == Split(2, 0, "fused")
    assert plan.prefill.admitted == ("w",)
    assert [(s.request_id, s.num_tokens) for s in plan.prefill.decode] == [
        (f"d{i}", 1) for i in range(8)
    ]
    decode_plan = policy.plan_decode(snap())
    assert decode_plan.split.rule == "fused" and decode_plan.split.decode == 0

    # The prompt's 4 blocks and one block per row: 12. With 11 the prompt waits (the batch
    # keeps a block per decoding request free), so nothing is fused.
    assert policy.plan_prefill(snap(free_blocks=12)).split.rule == "fused"
    assert policy.plan_prefill(snap(free_blocks=11)).prefill is None
    for in_flight in (PrefillInFlight(waiting, 0, stepping=True), PrefillInFlight(waiting, 8)):
        assert policy.plan_decode(snap(prefill=in_flight)).split.rule != "fused"
    sharing = POLICIES["cpu"].plan_prefill(snap())
    assert sharing.split == Split(1, 1, "decode-grows") and not sharing.prefill.decode
    for other in (
        make_policy(zero_sum, fuse=False),
        make_policy(zero_sum, layers_per_step=8),
        make_policy(zero_sum, partition="static", static=Split(1, 1, "static")),
    ):
        plan = other.plan_prefill(snap())
        assert plan.split.rule != "fused" and not plan.prefill.decode


def test_gpu_fuses_a_prefill_into_the_decode_step_only_within_a_tpot():
    """On a GPU preset whose bandwidth scales with SMs (N_d = all of them), side by side the
    lanes do about the work they do one after the other, while a prompt's tokens ride in a
    memory-bound decode step almost for free: a short prompt beside a decode batch is fused
    (`fused`, every SM, every decoding request's row). A prompt whose fused step would hold
    the rows past the TPOT budget rides in the longest chunk that fits, and its rest in the
    steps after; where not even a chunk fits beside the rows, the lanes share the GPU and
    decode keeps stepping. Nothing is fused with fusing off."""
    policy = POLICIES["h100"]
    budget = policy.slo.tpot_s * 0.8

    def snap(prompt: int, rows: int = 64, context: int = 1001, prefill=None) -> BulletSnapshot:
        decoding = tuple(SeqView(f"d{i}", 0.0, context, context - 1, 63) for i in range(rows))
        waiting = () if prefill else (SeqView("w", 99.99, prompt, 0, 0),)
        stats = LatencyStats(0.5, 0.05 / 0.15)
        return BulletSnapshot(
            100.0,
            waiting,
            prefill,
            decoding,
            100_000,
            BLOCK,
            256,
            16384,
            stats,
            Split(66, 66, "decode-fewest"),
        )

    short = snap(64)
    plan = policy.plan_prefill(short)
    fusion = policy.situation(short, short.waiting, plan.prefill, True).fusion
    assert plan.split == Split(132, 0, "fused")
    assert [s.request_id for s in plan.prefill.decode] == [f"d{i}" for i in range(64)]
    assert plan.prefill.chunk is None and plan.prefill.admitted == ("w",)
    assert policy.plan_decode(short).split.rule == "fused"
    assert fusion.gain > 1.0 and fusion.seconds <= budget

    long = snap(8000)
    plan = policy.plan_prefill(long)
    chunk = plan.prefill.chunk
    assert plan.split.rule == "fused" and plan.prefill.admitted == ("w",)
    assert chunk is not None and chunk % CHUNK_GRANULE == 0 and chunk < 8000
    assert policy.estimator().fused_step(long.waiting, None, (1001,) * 64).seconds > budget
    assert policy.estimator().fused_step(long.waiting, chunk, (1001,) * 64).seconds <= budget
    longer = chunk + CHUNK_GRANULE
    assert policy.estimator().fused_step(long.waiting, longer, (1001,) * 64).seconds > budget
    # Its rest, in flight between steps, goes on in chunks (nothing new is admitted).
    begun = PrefillInFlight((SeqView("w", 99.99, 8000, chunk, 500),), 0)
    plan = policy.plan_prefill(snap(8000, prefill=begun))
    assert plan.split.rule == "fused" and plan.prefill.admitted == ()
    assert plan.prefill.chunk is None or plan.prefill.chunk <= 8000 - chunk
    # While a step of it runs, the decode lane does not plan for a fused step.
    running = dataclasses.replace(begun, stepping=True)
    assert policy.plan_decode(snap(8000, prefill=running)).split.rule != "fused"

    crowded = snap(8000, rows=128, context=32_000)
    assert (
        policy.estimator().fused_step(crowded.waiting, CHUNK_GRANULE, (32_000,) * 128).seconds
        > budget
    )
    plan = policy.plan_prefill(crowded)
    assert plan.split.rule != "fused" and not plan.prefill.decode
    assert POLICIES["h100-no-fuse"].plan_prefill(short).split.rule == "decode-fewest"


def test_a_fused_step_fills_its_tpot_budget_and_outlasts_it_only_for_late_prompts():
    """Where the whole batch would hold the decode rows past the TPOT budget, the fused step
    takes as many whole prompts from the batch's front as fit (not the first alone: the rows
    cost the same however few prompt tokens ride with them). Where recent first tokens are
    late and recent TPOT holds, the whole batch fuses past the budget (`fused-ttft-first`);
    not while TPOT misses."""
    policy = dataclasses.replace(POLICIES["h100"], slo=SLO(3.0, 30.0))
    budget = policy.slo.tpot_s * 0.8
    rows = (1001,) * 64

    def snap(stats: LatencyStats) -> BulletSnapshot:
        decoding = tuple(SeqView(f"d{i}", 0.0, 1001, 1000, 63) for i in range(64))
        waiting = tuple(
            SeqView(f"w{i}", 99.99, n, 0, 0) for i, n in enumerate((200, 400, 400, 400, 400))
        )
        return BulletSnapshot(
            100.0,
            waiting,
            None,
            decoding,
            100_000,
            BLOCK,
            256,
            16384,
            stats,
            Split(66, 66, "decode-fewest"),
        )

    in_time = snap(LatencyStats(0.5, 0.02 / 0.03))
    batch = policy._form_batch(in_time, policy.estimator())
    assert len(batch) > 2 and policy.estimator().fused_step(batch, None, rows).seconds > budget
    plan = policy.plan_prefill(in_time)
    taken = len(plan.prefill.admitted)
    assert plan.split.rule == "fused" and plan.prefill.chunk is None and taken >= 2
    assert plan.prefill.admitted == tuple(s.request_id for s in batch[:taken])
    assert policy.estimator().fused_step(batch[:taken], None, rows).seconds <= budget
    assert policy.estimator().fused_step(batch[: taken + 1], None, rows).seconds > budget

    late = policy.plan_prefill(snap(LatencyStats(1.5, 0.02 / 0.03)))
    assert late.split == Split(132, 0, "fused-ttft-first")
    assert late.prefill.admitted == tuple(s.request_id for s in batch)
    assert len(late.prefill.decode) == 64
    assert policy.plan_decode(snap(LatencyStats(1.5, 0.02 / 0.03))).split.rule == "fused-ttft-first"
    tpot_missing = policy.plan_prefill(snap(LatencyStats(1.5, 0.04 / 0.03)))
    assert tpot_missing.split.rule == "fused" and len(tpot_missing.prefill.admitted) == taken


def test_tpot_over_its_slo_never_starves_an_at_risk_prompt():
    """While P90 TPOT misses, decode takes units from prefill one granule a step; it may take
    them all only until a waiting prompt is at risk (the window's TTFT, fed at first tokens,
    cannot show a prefill that is not running)."""
    decoding = tuple(SeqView(f"d{i}", 0.0, 300, 299, 19) for i in range(30))

    def snap(total: int, waited_s: float) -> BulletSnapshot:
        waiting = (SeqView("w", 100.0 - waited_s, 40, 0, 0),)
        stats = LatencyStats(0.5, 0.2 / 0.15)  # recent first tokens in time; TPOT over its 150 ms
        return BulletSnapshot(
            100.0,
            waiting,
            None,
            decoding,
            10_000,
            BLOCK,
            64,
            16384,
            stats,
            Split(0, total, "no-prefill"),
        )

    for name, total in (("cpu", 2), ("h100-no-fuse", 132)):
        policy = POLICIES[name]
        assert policy.plan_decode(snap(total, 0.0)).split == Split(0, total, "decode-grows")
        late = snap(total, 1.0)
        assert policy.estimator().at_risk(late.waiting[0], late.now)
        for plan in (policy.plan_prefill(late), policy.plan_decode(late)):
            if name == "cpu":
                # TTFT misses where the lanes take turns: chunked prefill's step, the prompt
                # with the decode rows on every unit.
                assert plan.split == Split(total, 0, "chunked-plan")
            else:
                assert 0 < plan.split.prefill < total


def test_the_chunked_plan_fills_the_token_budget_where_the_model_is_off():
    """With the model's recent predictions off beyond the bound, the prefill lane runs what a
    chunked engine would: the prompts that fit the token budget beside the decode rows, past
    the saturation point that caps a batch otherwise, and a chunk of the first prompt where it
    alone is over the budget."""
    policy = POLICIES["h100"]
    off = dataclasses.replace(HOLDING, model_error=0.5)
    decoding = _decoding(48)
    prompts = tuple(SeqView(f"w{i}", 100.0, 5000, 0, 0) for i in range(4))
    plan = policy.plan_prefill(_rule_snapshot(prompts, decoding, off))  # a 16,384-token budget
    assert plan.split == Split(policy.units.total, 0, "chunked-plan")
    assert plan.prefill.admitted == ("w0", "w1", "w2") and plan.prefill.chunk is None
    assert policy.saturation_tokens < 15000  # what caps a batch where the model is trusted
    assert [s.request_id for s in plan.prefill.decode] == [s.request_id for s in decoding]
    trusted = policy.plan_prefill(_rule_snapshot(prompts, decoding, HOLDING))
    assert trusted.split.rule != "chunked-plan"
    long = (SeqView("long", 100.0, 20_000, 0, 0),)
    plan = policy.plan_prefill(_rule_snapshot(long, decoding, off))
    assert plan.split.rule == "chunked-plan" and plan.prefill.chunk == 16320  # 64 x 255


def test_the_window_tracks_the_models_recent_error():
    window = LatencyWindow(SLO(1.0, 100.0), size=64)
    for _ in range(MODEL_ERROR_STEPS - 1):
        window.step(predicted_s=0.1, measured_s=0.2)
    assert window.stats().model_error is None  # too few steps to judge
    window.step(predicted_s=0.1, measured_s=0.2)
    assert window.stats().model_error == pytest.approx(0.5)
    for _ in range(MODEL_ERROR_STEPS // 2 + 1):
        window.step(predicted_s=0.2, measured_s=0.2)
    assert window.stats().model_error == 0.0


def test_the_window_counts_ttft_at_the_first_token():
    window = LatencyWindow(SLO(1.0, 100.0), size=64)
    window.first_token(0.2, 100)  # twice its 100 ms SLO, while the request still decodes
    assert window.stats() == LatencyStats(p90_ttft_over_slo=pytest.approx(2.0))
    window.finished(0.05)  # half its 100 ms SLO
    assert window.stats().p90_tpot_over_slo == pytest.approx(0.5)
    window.finished(0.3, SLO(1.0, 200.0))  # a request with targets of its own
    assert window.stats().p90_tpot_over_slo == pytest.approx(1.5)
    for _ in range(20):  # many more of the server's SLO that hold do not hide the class's miss
        window.finished(0.05)
    assert window.stats().p90_tpot_over_slo == pytest.approx(1.5)


def test_static_and_none_partitions():
    static = make_policy(CPU, partition="static", static=Split(1, 1, "static"))
    none = make_policy(CPU, partition="none")
    decoding = (SeqView("d", 0.0, 100, 99, 7),)
    waiting = (SeqView("w", 99.9, 200, 0, 0),)
    snap = BulletSnapshot(
        100.0, waiting, None, decoding, 100, BLOCK, 8, 2048, LatencyStats(), Split(1, 1, "static")
    )
    assert static.plan_prefill(snap).split == Split(1, 1, "static")
    assert none.plan_prefill(snap).split == Split(2, 2, "none")
    with pytest.raises(ValueError, match="static split"):
        make_policy(CPU, partition="static", static=Split(2, 1, "static"))


def test_ttft_slo_with_a_fixed_part():
    """A fixed part of the TTFT SLO gives short prompts room: a 10-token prompt that waited
    0.1 s is at risk on 3 ms/token alone (30 ms budget) but not with 500 ms more; the window
    tracks each TTFT over its own request's SLO."""
    cfg = PRESETS["llama-3.1-8b"]
    slo = SLO(3.0, 150.0, 500.0)
    policy = make_policy(H100)
    with_base = BulletPolicy(
        perf=policy.perf,
        units=policy.units,
        num_layers=cfg.num_layers,
        slo=slo,
    )
    short = SeqView("short", 99.9, 10, 0, 0)
    assert policy.estimator().at_risk(short, 100.0)
    assert not with_base.estimator().at_risk(short, 100.0)
    assert slo.ttft_s(10) == pytest.approx(0.53)
    window = LatencyWindow(slo, size=64)
    for ttft, tokens in ((0.53, 10), (0.25, 10), (1.1, 200)):
        window.first_token(ttft, tokens)
    assert window.stats().p90_ttft_over_slo == pytest.approx(1.0)


def test_a_lane_never_runs_on_a_small_remainder():
    space = UnitSpace(132, 8, 8, min_remainder=24)
    assert space.is_valid(8) and space.is_valid(124)  # a carved 8 and what it leaves
    assert not space.is_valid(12) and not space.is_valid(20)  # beside 120 and 112
    assert space.is_valid(28) and space.least_remainder == 24
    assert UnitSpace(132, 8, 8).is_valid(12)  # without the floor, as in the simulator


def _rule_snapshot(waiting, decoding, stats, waited_s=0.0, seats=64) -> BulletSnapshot:
    waiting = tuple(dataclasses.replace(s, arrival_time=100.0 - waited_s) for s in waiting)
    return BulletSnapshot(
        100.0, waiting, None, decoding, 100_000, BLOCK, seats, 16384, stats, Split(0, 0, "none")
    )


def _decoding(count: int, context: int = 300) -> tuple[SeqView, ...]:
    blocks = -(-context // BLOCK)
    return tuple(SeqView(f"d{i}", 0.0, context, context - 1, blocks) for i in range(count))


PROMPT = (SeqView("w", 100.0, 256, 0, 0),)
HOLDING = LatencyStats(0.5, 0.05 / 0.15)  # P90 TTFT within its SLO, P90 TPOT within its 150 ms
TPOT_MISSING = LatencyStats(0.5, 0.2 / 0.15)  # P90 TTFT within its SLO, P90 TPOT over it


def _behind(count: int, priority: int = 0) -> tuple[SeqView, ...]:
    """Decoding requests 200 ms a token since their first token 2 s ago: behind their 150 ms."""
    return tuple(
        dataclasses.replace(s, priority=priority, first_token_time=98.0, num_output_tokens=10)
        for s in _decoding(count)
    )


# Each rule, on a policy and a snapshot where it is the first of the table to fire.
RULE_CASES = {
    "none": (make_policy(CPU, partition="none"), _rule_snapshot(PROMPT, _decoding(4), HOLDING)),
    "no-prefill": (POLICIES["h100"], _rule_snapshot((), _decoding(4), HOLDING)),
    "no-decode": (POLICIES["h100"], _rule_snapshot(PROMPT, (), HOLDING)),
    "static": (
        make_policy(CPU, partition="static", static=Split(1, 1, "static")),
        _rule_snapshot(PROMPT, _decoding(4), HOLDING),
    ),
    "decode-first": (
        POLICIES["cpu"],
        _rule_snapshot((dataclasses.replace(PROMPT[0], priority=1),), _behind(4), HOLDING),
    ),
    "chunked-plan": (
        POLICIES["h100"],
        _rule_snapshot(PROMPT, _decoding(4), dataclasses.replace(HOLDING, model_error=0.5)),
    ),
    "fused-ttft-first": (
        dataclasses.replace(POLICIES["h100"], slo=SLO(3.0, 30.0)),
        _rule_snapshot(
            tuple(SeqView(f"w{i}", 0.0, n, 0, 0) for i, n in enumerate((200, 400, 400, 400))),
            _decoding(64, 1001),
            LatencyStats(1.5, 0.02 / 0.03),
            waited_s=0.01,
            seats=256,
        ),
    ),
    "fused": (
        make_policy(dataclasses.replace(CPU, bandwidth_saturation_units=2)),
        _rule_snapshot((SeqView("w", 100.0, 64, 0, 0),), _decoding(8, 321), TPOT_MISSING),
    ),
    "turns": (
        make_policy(dataclasses.replace(CPU, bandwidth_saturation_units=2), fuse=False),
        _rule_snapshot(PROMPT, _decoding(4), HOLDING),
    ),
    "at-risk-first": (
        POLICIES["h100-no-fuse"],
        _rule_snapshot(PROMPT, _decoding(4), HOLDING, waited_s=5.0),
    ),
    "balance": (
        POLICIES["h100-no-fuse"],
        _rule_snapshot(PROMPT, _decoding(32, 1000), LatencyStats(1.5, 0.3 / 0.15)),
    ),
    "decode-fewest": (POLICIES["h100-no-fuse"], _rule_snapshot(PROMPT, _decoding(32), HOLDING)),
    "decode-grows": (
        POLICIES["h100-no-fuse"],
        _rule_snapshot(PROMPT, _decoding(32, 1000), LatencyStats(0.5, 0.3 / 0.15)),
    ),
}


def test_the_rule_table_is_ordered_named_and_total():
    assert list(RULE_CASES) == sorted(RULE_CASES, key=RULE_NAMES.index)
    assert len(set(RULE_NAMES)) == len(RULE_NAMES) == len(RULE_CASES)
    assert {rule.origin for rule in RULES} <= {"Algorithm 1", "ablation", "extension"}
    # The last rule fires whatever the situation: here one where no other would.
    policy, snap = RULE_CASES["decode-grows"]
    step = policy.plan_prefill(snap).prefill
    situation = policy.situation(snap, snap.waiting, step, True)
    assert RULES[-1].decide(situation) is not None


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_each_rule_fires_by_name_in_both_lanes_plans(rule):
    policy, snap = RULE_CASES[rule]
    prefill_plan, decode_plan = policy.plan_prefill(snap), policy.plan_decode(snap)
    assert prefill_plan.split.rule == decode_plan.split.rule == rule
    assert prefill_plan.split == decode_plan.split
    check_split(policy, prefill_plan.split)
    fused = rule in ("fused", "fused-ttft-first", "chunked-plan")
    assert bool(prefill_plan.prefill and prefill_plan.prefill.decode) == fused


def test_a_table_without_a_rule_is_an_ablation_and_one_without_a_last_rule_fails_loudly():
    policy, snap = RULE_CASES["fused"]
    unfused = dataclasses.replace(
        policy, rules=tuple(r for r in RULES if r.name not in ("fused", "fused-ttft-first"))
    )
    plan = unfused.plan_prefill(snap)
    assert plan.split.rule not in ("fused", "fused-ttft-first") and not plan.prefill.decode
    truncated = dataclasses.replace(policy, rules=RULES[:3])
    with pytest.raises(RuntimeError, match="the last must always fire"):
        truncated.plan_prefill(snap)


def test_the_policy_predicts_with_the_snapshot_s_corrections():
    """The policy reads the performance model's online corrections from its snapshot, not
    from the model: a snapshot that says decode runs 3x slower than modeled gives decode
    more units."""
    from bulletserve.perf.model import Corrections

    policy, snap = RULE_CASES["decode-fewest"]
    slow = dataclasses.replace(snap, corrections=Corrections(decode=3.0))
    assert policy.plan_prefill(snap).split.rule == "decode-fewest"
    assert policy.plan_prefill(slow).split.decode > policy.plan_prefill(snap).split.decode


def test_each_request_is_held_to_its_own_slo_and_the_queue_to_priorities():
    """A request's own TTFT target decides when it is at risk (earliest deadline first among
    those at risk), the tightest TPOT target of the decoding requests sizes the decode lane's
    budget, a prompt that would miss its target even if it started now waits behind those
    that can still make theirs, and priorities order the queue before all of that."""
    policy = POLICIES["h100"]  # the server's SLO: 3 ms a prompt token, TPOT 150 ms
    est = policy.estimator()
    tight = SLO(0.5, 40.0)  # 250 ms for a prompt of 500 tokens
    assert est.at_risk(SeqView("tight", 99.8, 500, 0, 0, slo=tight), 100.0)
    assert not est.at_risk(SeqView("default", 99.8, 500, 0, 0), 100.0)
    decoding = (SeqView("d0", 0.0, 300, 299, 19, slo=tight), SeqView("d1", 0.0, 300, 299, 19))
    assert policy.estimator(decoding=decoding).tpot_budget_s == pytest.approx(0.04 * 0.8)
    assert policy.estimator(decoding=decoding[1:]).tpot_budget_s == pytest.approx(0.15 * 0.8)
    waiting = (
        SeqView("lost", 98.0, 500, 0, 0),  # 2 s of its 1.5 s passed
        SeqView("late-default", 98.8, 500, 0, 0),  # at risk: deadline 100.3
        SeqView("late-tight", 99.82, 500, 0, 0, slo=tight),  # at risk: deadline 100.07
        SeqView("short", 100.0, 50, 0, 0),
        SeqView("first", 100.0, 900, 0, 0, priority=-1),
    )
    assert est.past_deadline(waiting[0], 100.0) and not est.past_deadline(waiting[2], 100.0)
    snap = dataclasses.replace(_rule_snapshot((), decoding, HOLDING), waiting=waiting)
    order = [s.request_id for s in policy.order_waiting(snap)]
    assert order == ["first", "late-tight", "late-default", "short", "lost"]


def test_prompts_that_rank_below_requests_behind_their_tpot_wait_while_they_have_slack():
    """Where the lanes take turns (a CPU), decode runs alone while requests behind their own
    TPOT target outrank every queued prompt and no prompt is at risk; not when the ranks are
    equal (one SLO, one priority: the rules as before), not when a prompt is at risk, not
    when the decoding requests keep their TPOT, and not on a GPU."""
    policy, snap = RULE_CASES["decode-first"]
    est = policy.estimator()
    assert est.behind_tpot(snap.decoding[0], 100.0)
    assert not est.behind_tpot(snap.decoding[0], 99.0)  # 100 ms a token
    assert not est.behind_tpot(_decoding(1)[0], 100.0)  # no first token yet
    assert policy.plan_decode(snap).split == Split(0, 2, "decode-first")
    assert policy.plan_prefill(snap).split.rule == "decode-first"

    def rule(**changes) -> str:
        return policy.plan_prefill(dataclasses.replace(snap, **changes)).split.rule

    assert rule(waiting=PROMPT) == "chunked-plan"  # equal ranks
    assert rule(decoding=_decoding(4)) == "chunked-plan"  # in time
    # A tighter TPOT target outranks at one priority too.
    tighter = tuple(dataclasses.replace(s, slo=SLO(3.0, 100.0)) for s in snap.decoding)
    assert rule(waiting=PROMPT, decoding=tighter) == "decode-first"
    at_risk = _rule_snapshot(snap.waiting, snap.decoding, HOLDING, waited_s=5.0)
    assert policy.plan_prefill(at_risk).split.rule != "decode-first"
    assert POLICIES["h100"].plan_prefill(snap).split.rule != "decode-first"


def test_a_prefill_batch_holds_one_priority():
    """A lower priority's prompt does not join a batch that gives a higher one its first
    token (its tokens would lengthen that step); the next batch takes it."""
    policy = POLICIES["cpu"]
    waiting = (
        SeqView("a", 100.0, 200, 0, 0),
        SeqView("b", 100.0, 200, 0, 0),
        SeqView("low", 100.0, 100, 0, 0, priority=1),
    )
    snap = _rule_snapshot(waiting, (), HOLDING)
    assert policy.plan_prefill(snap).prefill.admitted == ("a", "b")
    alone = _rule_snapshot(waiting[2:], (), HOLDING)
    assert policy.plan_prefill(alone).prefill.admitted == ("low",)
