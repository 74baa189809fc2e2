"""Mixed workloads: service classes, how requests are drawn into them, what they send, and
how runs are scored per class, served and simulated alike."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bulletserve.bench.classes import (
    WorkloadClass,
    assign_classes,
    check_classes,
    parse_workload_class,
)
from bulletserve.bench.http_client import Target
from bulletserve.bench.records import RequestRecord
from bulletserve.bench.serving_metrics import summarize
from bulletserve.cli import main
from bulletserve.sched.slo import SLO

INTERACTIVE = WorkloadClass("interactive", 0.3, SLO(2.0, 100.0), 0)
BATCH = WorkloadClass("batch", 0.7, SLO(20.0, 1000.0), 1)


def test_a_class_flag_parses_and_bad_ones_say_why():
    assert parse_workload_class("interactive:0.3:2,100:0") == INTERACTIVE
    assert parse_workload_class("batch:0.7:20,1000") == WorkloadClass("batch", 0.7, SLO(20, 1000))
    with_base = parse_workload_class("chat:0.5:2,100,50:-1")
    assert with_base == WorkloadClass("chat", 0.5, SLO(2, 100, 50), -1)
    for bad in (
        "a:0.5", "a:x:2,100", "a:0.5:2", "a:1.5:2,100", ":0.5:2,100", "a:0.5:2,100:x",
        "a:0.5:2,100,-1", "a:0.5:2,100,5,6",
    ):  # fmt: skip
        with pytest.raises(ValueError):
            parse_workload_class(bad)
    with pytest.raises(ValueError, match="sum to 0.6"):
        check_classes([INTERACTIVE, WorkloadClass("b", 0.3, SLO(1, 1))])
    with pytest.raises(ValueError, match="repeat"):
        check_classes([BATCH, WorkloadClass("batch", 0.3, SLO(1, 1))])


def test_classes_are_drawn_in_exact_shares_by_the_seed():
    drawn = assign_classes(101, [INTERACTIVE, BATCH], seed=4)
    assert Counter(c.name for c in drawn) == {"interactive": 30, "batch": 71}
    assert drawn == assign_classes(101, [INTERACTIVE, BATCH], seed=4)
    assert drawn != assign_classes(101, [INTERACTIVE, BATCH], seed=5)


def test_a_request_sends_its_class_only_where_asked():
    plain = Target("http://127.0.0.1:1", "m")
    assert "priority" not in plain.payload("hi", 4, INTERACTIVE)
    both = Target("http://127.0.0.1:1", "m", send_priority=True, send_slo=True)
    body = both.payload("hi", 4, BATCH)
    assert body["priority"] == 1 and body["slo"] == "batch"


def test_each_request_is_scored_against_its_class():
    def record(index: int, name: str, ttft_s: float) -> RequestRecord:
        return RequestRecord(
            index, input_len=100, max_tokens=3, arrival_s=0.0, output_len=3, ttft_s=ttft_s,
            e2el_s=ttft_s + 0.1, success=True, slo_class=name,
        )  # fmt: skip

    # TTFT 0.5 s on 100 tokens: within batch's 2 s, past interactive's 0.2 s.
    records = [
        record(0, "interactive", 0.1),
        record(1, "interactive", 0.5),
        record(2, "batch", 0.5),
    ]
    summary = summarize(records, 2.0, classes=[INTERACTIVE, BATCH])
    assert summary["classes"]["interactive"]["attainment"] == 0.5
    assert summary["classes"]["batch"]["attainment"] == 1.0
    assert summary["classes"]["batch"]["goodput"] == 0.5
    assert summary["slo"]["attainment"] == pytest.approx(2 / 3) and summary["slo"]["met"] == 2


def test_simulate_scores_a_mixed_workload_per_class(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    argv = [
        "simulate", "--hardware", "h100", "--model", "llama-3.1-8b", "--policy", "bullet",
        "--dataset", "azure-code-like", "--num-prompts", "60", "--request-rate", "4",
        "--service-class", "interactive:0.3:2,100:0", "--service-class", "batch:0.7:20,1000:1",
        "--send-slo", "--send-priority", "--scheduling-policy", "priority", "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert "SLO attainment per class" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    assert {r["slo_class"] for r in run["requests"]} == {"interactive", "batch"}
    assert run["summary"]["classes"]["interactive"]["requests"] == 18
    assert main([*argv[:-2], "--send-priority", "--scheduling-policy", "fcfs"]) == 2
    assert "--send-priority needs --scheduling-policy priority" in capsys.readouterr().err
    assert main(["simulate", "--hardware", "h100", "--model", "tiny", "--send-slo"]) == 2
    assert "--send-priority and --send-slo need --service-class" in capsys.readouterr().err
