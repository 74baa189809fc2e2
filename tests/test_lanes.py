"""The two-lane executor on a tiny random model (fp32): same greedy output as prefill-first,
preemption and aborts under concurrency, a step log."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from bulletserve import LLM, SamplingParams
from bulletserve.bookkeeping.record import read_step_log
from bulletserve.partition.cpu import use_one_thread
from bulletserve.sched.bullet import RULE_NAMES, Split, parse_partition
from tests.tiny_models import TINY_LLAMA_BLOCK_BYTES, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _bullet_llm(model_dir, **settings) -> LLM:
    """The tiny model in fp32 under the bullet policy."""
    return LLM(
        model=str(model_dir), dtype="float32", max_model_len=256, policy="bullet", **settings
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, policy="prefill-first")
    return [o.token_ids for o in llm.generate(random_prompts(12, seed=21), GREEDY)]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"prefill_layers_per_step": 1},
        {"partition": "none"},
        {"partition": "static:1/1"},
        {"prefill_layers_per_step": 1, "kv_cache_memory": str(16 * TINY_LLAMA_BLOCK_BYTES)},
    ],
    ids=["auto", "layer-groups", "none", "static", "preempting"],
)
def test_bullet_greedy_equals_prefill_first(tiny_llama_dir, reference, settings, tmp_path):
    log = tmp_path / "steps.jsonl"
    llm = _bullet_llm(tiny_llama_dir, num_threads=2, step_log=str(log), **settings)
    try:
        outputs = llm.generate(random_prompts(12, seed=21), GREEDY)
        assert [o.token_ids for o in outputs] == reference
        assert llm.engine.pool.allocator.num_used == 0
        if "kv_cache_memory" in settings:
            assert llm.engine.num_preemptions > 0
    finally:
        llm.engine.close()
    records = read_step_log(log)
    assert {r.lane for r in records} == {"prefill", "decode"}
    for record in records:
        assert record.measured_s > 0 and record.predicted_s > 0
        assert 0 < record.runner_s <= record.measured_s  # the model's time within the step
        assert len(record.split) == 2
        assert record.rule in RULE_NAMES
        es = record.state
        if record.lane == "decode":
            assert es.decode_batch == record.batch_size
        else:
            assert es.prefill_tokens == record.tokens
    if settings.get("partition", "auto") != "auto":
        assert {r.rule for r in records} <= {"none", "static", "no-prefill", "no-decode"}
    layer_ranges = [r.layers for r in records if r.lane == "prefill"]
    if settings.get("prefill_layers_per_step") == 1:
        assert {(0, 1), (1, 2)} <= set(layer_ranges)
    else:
        assert set(layer_ranges) == {(0, 2)}


@pytest.mark.parametrize("chunks", [False, True], ids=["whole", "chunks"])
def test_decode_rows_ride_in_a_prefill_step_on_a_cpu_where_co_running_is_zero_sum(
    tiny_llama_dir, tmp_path, chunks
):
    """Prompts that arrive while others decode, on a CPU profile whose threads split compute and
    bandwidth evenly: a prefill step carries the decode rows (`fused`, or chunked prefill's
    plan), and every request gets prefill-first's greedy tokens; requests aborted meanwhile
    free their blocks.

    With long prompts they ride in chunks, each chunk's step on top of the ones before it:
    the profile predicts steps 100 times faster than any step of this engine runs, so the
    model is off beyond its bound and the policy runs chunked prefill's plan, whose token
    budget (128, less the rows, in multiples of 64) holds a 64-token chunk of a prompt."""
    from bulletserve.perf.hardware import HardwareProfile

    profile = tmp_path / "cpu.json"
    speed = 100.0 if chunks else 1.0
    HardwareProfile(
        "cpu", "cpu", True, 2, 1, 1, {"float32": 1e11 * speed}, 2e10 * speed, 2, 1e-4 / speed
    ).save(profile)
    low, high = (150, 220) if chunks else (5, 40)
    prompts = random_prompts(8, seed=26, low=low, high=high)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    reference = LLM(
        model=str(tiny_llama_dir), dtype="float32", max_model_len=256, policy="prefill-first"
    )
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    log = tmp_path / "steps.jsonl"
    budget = {"max_num_batched_tokens": 128} if chunks else {}
    llm = _bullet_llm(
        tiny_llama_dir, num_threads=2, step_log=str(log), hardware_profile=str(profile), **budget
    )
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    try:
        ids = [engine.add_request(prompts[0], params)]
        for prompt in prompts[1:]:
            # Each prompt comes once the requests before it have a few tokens each.
            while engine.has_unfinished() and time.monotonic() < deadline:
                for output in engine.step():
                    tokens[output.request_id] = output.token_ids
                if all(len(tokens.get(i, [])) >= 3 for i in ids):
                    break
            ids.append(engine.add_request(prompt, params))
        doomed = [
            engine.add_request(p, params) for p in random_prompts(3, seed=27, low=low, high=high)
        ]
        while engine.has_unfinished() and time.monotonic() < deadline:
            outputs = engine.step()
            for output in outputs:
                tokens[output.request_id] = output.token_ids
            if outputs and doomed:
                for request_id in doomed:
                    engine.abort_request(request_id)
                doomed = []
        assert not engine.has_unfinished()
        assert [tokens[i] for i in ids] == expected
        assert engine.pool.allocator.num_used == 0
    finally:
        engine.close()
    records = read_step_log(log)
    fused_rules = ("fused", "fused-ttft-first", "chunked-plan")
    fused = [r for r in records if r.rule in fused_rules and r.lane == "prefill"]
    assert fused and all(r.decode_rows > 0 for r in fused)
    continued = 0
    for record in fused:
        es = record.state
        assert es.prefill_tokens == record.tokens and not es.has_decode
        assert es.prefill_lens[-record.decode_rows :] == (1,) * record.decode_rows
        if es.prefill_cached and es.prefill_cached[0] > 0:  # a chunk on top of earlier ones
            continued += 1
    assert (continued > 0) == chunks


def test_lanes_wait_for_their_outputs_to_be_handed_off_where_the_caller_reports_it(
    tiny_llama_dir, tmp_path
):
    """Under the server (whose AsyncEngine reports each hand-off) a lane plans its next step
    once the outputs emitted so far are written out, or HANDOFF_WAIT_S later: left unreported,
    each decode step starts that long after the one before ended; reported after every
    `step()`, nothing is left outstanding. `LLM.generate` reports nothing and waits for
    nothing."""
    from bulletserve.engine.config import HANDOFF_WAIT_S

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for report in (False, True):
        log = tmp_path / f"steps-{report}.jsonl"
        llm = _bullet_llm(tiny_llama_dir, step_log=str(log))
        engine = llm.engine
        engine.life.acks_handoff = True
        tokens = []
        deadline = time.monotonic() + 60
        try:
            engine.add_request(random_prompts(1, seed=28)[0], params)
            while engine.has_unfinished() and time.monotonic() < deadline:
                tokens += [o for o in engine.step() if o.finished]
                if report:
                    engine.outputs_handed_off()
            assert len(tokens) == 1 and len(tokens[0].token_ids) == 6
            if report:
                assert engine.executor._unhanded == 0
        finally:
            engine.close()
        records = read_step_log(log)
        decode = [r for r in records if r.lane == "decode"]
        assert len(decode) == 5
        if not report:
            for before, after in zip(decode, decode[1:], strict=False):
                assert after.time - after.measured_s - before.time >= 0.9 * HANDOFF_WAIT_S


def test_a_hundred_requests_under_bullet_with_a_small_pool(tiny_llama_dir):
    """Enough requests through a pool of a few prompts' blocks that preemption churns (a
    hundred: 300 took 15 s of the suite and found nothing more)."""
    llm = _bullet_llm(
        tiny_llama_dir,
        prefill_layers_per_step=1,
        kv_cache_memory=str(16 * TINY_LLAMA_BLOCK_BYTES),
    )
    rng = random.Random(3)
    prompts = random_prompts(100, seed=22, low=1, high=120)
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 30), temperature=rng.choice([0, 0.8]), ignore_eos=True
        )
        for _ in prompts
    ]
    start = time.monotonic()
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    assert time.monotonic() - start < 300  # no deadlock: bounded
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    allocator = llm.engine.pool.allocator
    assert allocator.num_free == allocator.num_blocks
    assert llm.engine.num_preemptions > 0


def test_abort_in_either_lane_frees_blocks(tiny_llama_dir):
    llm = _bullet_llm(tiny_llama_dir, prefill_layers_per_step=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    try:
        ids = [engine.add_request(p, params) for p in random_prompts(6, seed=23, low=50, high=120)]
        seen = []
        deadline = time.monotonic() + 60
        while len(seen) < 3 and time.monotonic() < deadline:
            seen += engine.step()
        for request_id in ids:
            engine.abort_request(request_id)
        finished = set()
        while engine.has_unfinished() and time.monotonic() < deadline:
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == set(ids)
        end = time.monotonic() + 5
        while engine.pool.allocator.num_used and time.monotonic() < end:
            time.sleep(0.01)
        assert engine.pool.allocator.num_used == 0
    finally:
        engine.close()


def test_both_lanes_plan_the_same_split_while_decode_steps(tiny_llama_dir):
    """While the decode lane computes its batch, the prefill lane must still see that batch:
    a prefill lane that saw no decodes planned the whole device for itself, waited for units
    the decode lane kept taking, and starved (TTFTs of 15 s in the CPU benchmark)."""
    # A fixed 1/1 split: under `auto` the split depends on what the profile says co-running
    # gains, and a prefill lane blind to the decodes would plan the whole device either way.
    llm = _bullet_llm(tiny_llama_dir, num_threads=2, partition="static:1/1")
    engine = llm.engine
    if engine.executor.units.total < 2:
        engine.close()
        pytest.skip("needs two units to split")
    try:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        for prompt in random_prompts(3, seed=24):
            engine.add_request(prompt, params)
        deadline = time.monotonic() + 60
        while len(engine.running) < 3 and time.monotonic() < deadline:
            engine.step()
    finally:
        engine.close()  # the lanes stop; the state stays as they left it
    assert len(engine.running) == 3
    engine.add_request(random_prompts(1, seed=25)[0], GREEDY)
    with engine.executor._state:
        decode_plan = engine.executor._plan("decode")
        assert decode_plan.split.decode > 0 and decode_plan.split.prefill > 0
        # The decode lane starts its step on its share of the units...
        engine.executor.core.start_decode(decode_plan)
        # ...and the prefill lane plans meanwhile: the same split, which it can start at once.
        prefill_plan = engine.executor._plan("prefill")
        assert prefill_plan.split == decode_plan.split
        assert engine.executor.core.runnable("prefill", prefill_plan)


def test_partition_flag_parsing():
    assert parse_partition("auto", 2) == ("auto", None)
    assert parse_partition("static:1/1", 2) == ("static", Split(1, 1, "static"))
    for uncovered in ("static:2/1", "static:1/0"):  # decode runs on what prefill leaves
        with pytest.raises(ValueError, match="must equal the device's 2 units"):
            parse_partition(uncovered, 2)
    with pytest.raises(ValueError, match="static:P/D"):
        parse_partition("static:x", 2)


def test_step_log_plots_the_split_over_time(tiny_llama_dir, tmp_path):
    from bulletserve.bench.steplog import plot_step_log

    log = tmp_path / "steps.jsonl"
    llm = _bullet_llm(tiny_llama_dir, step_log=str(log))
    try:
        llm.generate(random_prompts(4, seed=24), GREEDY)
    finally:
        llm.engine.close()
    png = plot_step_log(log, [], tmp_path / "split.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log.write_text(log.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"steps.jsonl:\d+: not a step-log line"):
        plot_step_log(log, [], tmp_path / "split.png")


@pytest.mark.parametrize("partition", ["auto", "static:1/1", "none"])
def test_only_the_team_thread_runs_multithreaded_steps(tiny_llama_dir, partition):
    """On a CPU every multi-threaded lane step runs on the one team thread (a lane thread that
    led an OpenMP team of its own would slow every parallel op); single-threaded steps run on
    the lane threads. Under `none` both lanes may want every thread at once: the second runs
    beside the busy team thread, on its own."""
    llm = _bullet_llm(tiny_llama_dir, num_threads=2, partition=partition)
    seen: list[tuple[str, int]] = []
    run_layers = llm.engine.model.run_layers

    def recording(*args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return run_layers(*args, **kwargs)

    llm.engine.model.run_layers = recording
    sampled_on: dict[str, set[tuple[str, int]]] = {"prefill": set(), "decode": set()}

    def recording_sampler(lane, sampler):
        sample = sampler.sample

        def recording_sample(*args, **kwargs):
            sampled_on[lane].add((threading.current_thread().name, torch.get_num_threads()))
            return sample(*args, **kwargs)

        sampler.sample = recording_sample

    recording_sampler("prefill", llm.engine.sampler)
    recording_sampler("decode", llm.engine.executor._decode_sampler)
    try:
        llm.generate(random_prompts(8, seed=4), GREEDY)
    finally:
        llm.engine.close()
    assert seen
    on_team = {threads for name, threads in seen if name == "bullet-team"}
    elsewhere = {(name, threads) for name, threads in seen if name != "bullet-team"}
    assert on_team == {2}
    if partition != "none":
        assert {threads for _, threads in elsewhere} <= {1}
    # A step samples where it ran, on every thread the step had (on one thread a decode step
    # sampled 160 rows in 30 ms), first tokens as well as decode rows.
    for lane in ("prefill", "decode"):
        assert ("bullet-team", 2) in sampled_on[lane]
        assert sampled_on[lane] <= set(seen)


def test_one_thread_holds_when_another_thread_sets_more_before_its_first_torch_call():
    """PyTorch sets a thread's intra-op count lazily, from the process-wide default that the
    last `torch.set_num_threads` anywhere left: a lane thread that set 1 and then waited while
    the team thread set 2 came back with 2 (and led an OpenMP team of its own)."""
    previous = torch.get_num_threads()
    pins = {
        "set_num_threads(1)": lambda: torch.set_num_threads(1),
        "use_one_thread": use_one_thread,
    }
    counts = {}

    def lane(name, pin, ready, other_done):
        pin()
        ready.set()
        other_done.wait(10)
        counts[name] = torch.get_num_threads()

    try:
        for name, pin in pins.items():
            ready, other_done = threading.Event(), threading.Event()
            thread = threading.Thread(target=lane, args=(name, pin, ready, other_done))
            thread.start()
            assert ready.wait(10)
            team = threading.Thread(target=torch.set_num_threads, args=(2,))
            team.start()
            team.join(10)
            other_done.set()
            thread.join(10)
    finally:
        torch.set_num_threads(previous)
    assert counts == {"set_num_threads(1)": 2, "use_one_thread": 1}
