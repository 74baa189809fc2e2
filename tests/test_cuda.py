"""The CUDA paths: green-context splits, the model on a GPU, and the lanes on SM groups.

Skipped where CUDA is absent (CI); `scripts/device_check.sh` runs them on a GPU.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from bulletserve import LLM, SamplingParams
from tests.tiny_models import TINY_LLAMA_BLOCK_BYTES, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def sms():
    from bulletserve.partition import unit_provider

    return unit_provider(torch.device("cuda"))


def _gemm_rate(units, count: int, rest: bool = False, n: int = 4096, steps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with units.lane(count, rest=rest):
        torch.mm(a, a)
        units.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            torch.mm(a, a)
        units.synchronize()
        return steps * 2 * n**3 / (time.perf_counter() - start)


def test_a_green_context_confines_a_gemm_to_its_sms(sms):
    assert sms.total >= 2 * sms.granularity
    small = sms.granularity * 2
    whole = _gemm_rate(sms, sms.total)
    confined = _gemm_rate(sms, small)
    # A compute-bound GEMM on 16 of 132 SMs cannot reach half the whole GPU's rate.
    assert confined < 0.5 * whole
    assert _gemm_rate(sms, small, rest=True) > 2 * confined


def test_work_after_a_lane_sees_what_the_lane_wrote(sms):
    """Lane streams are non-blocking: the caller's stream must wait for the lane's work before
    it reads the results (on an H200, sampling read a replayed graph's logits too early)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for count, rest in (
        (2 * sms.granularity, False),
        (2 * sms.granularity, True),
        (sms.total, False),
    ):
        flag = torch.zeros(1, device="cuda")
        with sms.lane(count, rest=rest):
            for _ in range(20):  # long enough that an unordered read would come first
                torch.mm(a, a)
            flag.fill_(1.0)
        assert flag.item() == 1.0


def test_two_lanes_on_disjoint_groups_run_side_by_side(sms):
    half = sms.total // 2 // sms.granularity * sms.granularity
    alone = _gemm_rate(sms, half)
    rates: dict[bool, float] = {}

    def run(rest: bool) -> None:
        rates[rest] = _gemm_rate(sms, half, rest=rest, steps=20)

    threads = [threading.Thread(target=run, args=(rest,)) for rest in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # Disjoint SMs: the group keeps most of its alone rate while the rest runs beside it.
    assert rates[False] > 0.7 * alone
    assert rates[True] > 0.7 * alone


def test_greedy_tokens_on_cuda_match_the_cpu(tiny_llama_dir):
    prompts = random_prompts(4, seed=3)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, device=device)
        outputs[device] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outputs["cuda"] == outputs["cpu"]


def _cuda_llm(model_dir, **settings) -> LLM:
    """The tiny model in fp32 on the GPU."""
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, device="cuda", **settings)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = _cuda_llm(tiny_llama_dir, policy="prefill-first", enforce_eager=True)
    return [o.token_ids for o in llm.generate(random_prompts(12, seed=21), GREEDY)]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"prefill_layers_per_step": 1},
        {"partition": "none"},
        {"partition": "static-half"},
        {"prefill_layers_per_step": 1, "kv_cache_memory": str(16 * TINY_LLAMA_BLOCK_BYTES)},
        {"enforce_eager": True},
    ],
    ids=["auto", "layer-groups", "none", "static", "preempting", "eager"],
)
def test_bullet_on_sm_groups_equals_prefill_first(tiny_llama_dir, reference, settings, sms):
    if settings.get("partition") == "static-half":
        half = sms.total // 2 // sms.granularity * sms.granularity
        settings = {"partition": f"static:{half}/{sms.total - half}"}
    llm = _cuda_llm(tiny_llama_dir, policy="bullet", **settings)
    try:
        outputs = llm.generate(random_prompts(12, seed=21), GREEDY)
        assert [o.token_ids for o in outputs] == reference
        assert llm.engine.pool.allocator.num_used == 0
    finally:
        llm.engine.close()


def test_decode_graphs_replay_the_eager_greedy_tokens(tiny_llama_dir, reference):
    llm = _cuda_llm(tiny_llama_dir, policy="prefill-first")
    graphs = llm.engine.runner.graphs
    captured = len(graphs._graphs)
    assert captured == len(graphs.batch_buckets)  # every bucket, at start
    outputs = llm.generate(random_prompts(12, seed=21), GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert len(graphs._graphs) == captured  # no request waited for a capture


@pytest.mark.parametrize(
    "settings",
    [
        {"policy": "chunked"},
        {"policy": "prefill-first", "enforce_eager": True},
        {"policy": "chunked", "logprobs": True},
    ],
    ids=["graphs", "eager", "logprobs"],
)
def test_async_scheduling_on_the_gpu_equals_the_serial_steps(
    tiny_llama_dir, reference, settings, tmp_path
):
    """Steps launched before the last one's tokens are on the host (fed from its draw on the
    device, read back through pinned memory), the step log timed by events."""
    from bulletserve.bookkeeping.record import read_step_log

    settings = dict(settings)
    params = GREEDY
    if settings.pop("logprobs", False):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    log = tmp_path / "steps.jsonl"
    llm = _cuda_llm(tiny_llama_dir, async_scheduling=True, step_log=str(log), **settings)
    outputs = llm.generate(random_prompts(12, seed=21), params)
    assert [o.token_ids for o in outputs] == reference
    assert llm.engine.pool.allocator.num_used == 0
    records = read_step_log(log)
    assert records and all(0 < r.measured_s < 5 for r in records)
    assert all(a.started <= b.started for a, b in itertools.pairwise(records))


def test_greedy_tokens_on_the_gpu_equal_the_cpus(tiny_llama_dir, reference):
    cpu = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, device="cpu")
    outputs = cpu.generate(random_prompts(12, seed=21), GREEDY)
    assert [o.token_ids for o in outputs] == reference


def test_a_graph_captured_on_a_green_context_stays_on_its_sms(sms):
    """A decode graph is captured on the lane's stream and replays there: the replay must keep to
    that stream's SMs, or a decode graph would take the whole GPU from the prefill lane. Last
    in the file: a capture that fails leaves PyTorch's CUDA generator in capture mode, and every
    later random draw in the process fails (an H200 run lost this test's error that way)."""
    from bulletserve.engine.cuda_graphs import capture_on_current_stream

    n, steps = 4096, 10
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    pool = torch.cuda.graph_pool_handle()

    def gemms() -> torch.Tensor:
        for _ in range(steps):
            out = torch.mm(a, a)
        return out

    def rate(count: int) -> float:
        with sms.lane(count):
            graph = torch.cuda.CUDAGraph()
            capture_on_current_stream(graph, pool, gemms)
            graph.replay()
            sms.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                graph.replay()
            sms.synchronize()
            return 3 * steps * 2 * n**3 / (time.perf_counter() - start)

    assert rate(2 * sms.granularity) < 0.5 * rate(sms.total)
