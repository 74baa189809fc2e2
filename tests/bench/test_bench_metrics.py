"""Metric code against values computed by hand on hand-made request records."""

from __future__ import annotations

import math

import pytest

from bulletserve.bench.records import RequestRecord
from bulletserve.bench.serving_metrics import attainment, summarize, tpot_s
from bulletserve.sched.slo import SLO


def _done(index: int, input_len: int, times: list[float]) -> RequestRecord:
    return RequestRecord(
        index=index,
        input_len=input_len,
        max_tokens=len(times),
        arrival_s=0.0,
        output_len=len(times),
        ttft_s=times[0],
        e2el_s=times[-1],
        token_times_s=times,
        success=True,
    )


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        _done(0, 10, [0.1, 0.2, 0.3, 0.4, 0.5]),  # TPOT 0.4 / 4 = 100 ms
        _done(1, 20, [0.3]),  # one output token: no TPOT
        _done(2, 4, [0.2, 0.5, 0.6]),  # TPOT 0.4 / 2 = 200 ms
        RequestRecord(3, 8, 16, 0.0, error="HTTP 500: boom"),
    ]


def test_counts_and_throughputs(records):
    s = summarize(records, duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (34, 9)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(21.5)
    assert "request_goodput" not in s and "slo" not in s


def test_latency_statistics(records):
    s = summarize(records, duration_s=2.0)
    ttft = s["ttft_ms"]  # [100, 300, 200]
    assert ttft["mean"] == pytest.approx(200)
    assert ttft["median"] == pytest.approx(200)
    assert ttft["p90"] == pytest.approx(280)
    assert ttft["p99"] == pytest.approx(298)
    assert ttft["std"] == pytest.approx(math.sqrt(20000 / 3))
    tpot = s["tpot_ms"]  # [100, 200]: the one-token request is left out
    assert (tpot["mean"], tpot["median"], tpot["std"]) == pytest.approx((150, 150, 50))
    assert (tpot["p90"], tpot["p99"]) == pytest.approx((190, 199))
    itl = s["itl_ms"]  # [100, 100, 100, 100, 300, 100]
    assert itl["mean"] == pytest.approx(800 / 6)
    assert itl["median"] == pytest.approx(100)
    assert itl["p90"] == pytest.approx(200)
    assert itl["p99"] == pytest.approx(290)
    e2el = s["e2el_ms"]  # [500, 300, 600]
    assert (e2el["mean"], e2el["median"]) == pytest.approx((1400 / 3, 500))


def test_tpot_leaves_out_one_token_and_failed_requests(records):
    assert tpot_s(records[0]) == pytest.approx(0.1)
    assert tpot_s(records[1]) is None
    assert tpot_s(records[3]) is None


def test_goodput(records):
    # ttft 250 ms and tpot 150 ms: only request 0 (request 1's TTFT is 300, request 2's TPOT 200)
    s = summarize(records, 2.0, goodput_ms={"ttft": 250, "tpot": 150})
    assert s["request_goodput"] == pytest.approx(0.5)
    # A one-token request counts as TPOT 0, as in vLLM: requests 0 and 1 meet tpot 150 ms.
    assert summarize(records, 2.0, goodput_ms={"tpot": 150})["request_goodput"] == 1.0
    assert summarize(records, 2.0, goodput_ms={"e2el": 550})["request_goodput"] == 1.0


def test_slo_attainment(records):
    # Normalized TTFT: 100/10 = 10, 300/20 = 15, 200/4 = 50 ms per token.
    result = attainment(records, SLO(ttft_per_token_ms=20, tpot_ms=150))
    assert result["met"] == 2  # requests 0 and 1; 2 misses TTFT, 3 failed
    assert result["attainment"] == pytest.approx(0.5)  # failed requests count as misses
    assert result["p90_norm_ttft_ms"] == pytest.approx(43)
    assert result["p90_tpot_ms"] == pytest.approx(190)
    assert attainment(records, SLO(60, 250))["attainment"] == pytest.approx(0.75)
    # A fixed part: request 2 (TTFT 200 ms, 4 tokens) meets 120 + 4 * 20 = 200 ms.
    with_base = attainment(records, SLO(20, 250, ttft_base_ms=120))
    assert with_base["met"] == 3 and with_base["ttft_base_ms"] == 120
    assert attainment(records, SLO(20, 250, ttft_base_ms=119))["met"] == 2


def test_all_failed_gives_nulls_not_errors():
    failed = [RequestRecord(i, 5, 5, 0.0, error="x") for i in range(3)]
    s = summarize(failed, 1.0, slo=SLO(1, 1))
    assert s["completed"] == 0 and s["failed"] == 3
    assert s["ttft_ms"]["mean"] is None and s["tpot_ms"]["p99"] is None
    assert s["slo"]["attainment"] == 0.0 and s["slo"]["p90_norm_ttft_ms"] is None
