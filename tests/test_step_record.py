"""The step record every step-log writer and reader shares."""

from __future__ import annotations

import json

import pytest

from bulletserve.bookkeeping.record import StepRecord, decode_busy_share, read_step_log, write_step
from bulletserve.perf.execution_state import ExecutionState


def test_a_record_round_trips_through_its_line(tmp_path):
    record = StepRecord(
        time=12.5,
        lane="prefill",
        split=(1, 1),
        units=1,
        batch_size=2,
        prefill_tokens=300,
        decode_rows=4,
        state=ExecutionState(prefill_lens=(100, 200, 1, 1, 1, 1), prefill_units=2),
        measured_s=0.25,
        rule="fused",
        predicted_s=0.2,
        runner_s=0.24,
        layers=(0, 30),
    )
    path = tmp_path / "steps.jsonl"
    with path.open("w") as handle:
        write_step(handle, record)
        write_step(handle, StepRecord(13.0, "decode", (1, 1), 1, 4, 0, 4, ExecutionState(), 0.1))
    first, second = read_step_log(path)
    assert first == record and first.tokens == 304 and first.started == 12.25
    assert json.loads(path.read_text().splitlines()[0])["tokens"] == 304
    assert second.rule is None and second.layers is None and second.tokens == 4


def test_logs_written_before_the_record_still_read():
    """As the engines wrote them up to 23ed970 (docs/ still links such logs): rows under
    `fused_decode` or `decode_seqs`, a decode lane's rows as its tokens, no lane units."""
    state = ExecutionState(decode_ctx=(300,) * 3, decode_units=1).to_json()
    lane_decode = {"time": 1.0, "lane": "decode", "split": [1, 1], "rule": "decode-fewest"}
    lane_decode |= {"batch_size": 3, "tokens": 3, "state": state, "measured_s": 0.05}
    record = StepRecord.from_json(lane_decode)
    assert (record.decode_rows, record.prefill_tokens, record.units) == (3, 0, 1)
    fused = lane_decode | {"lane": "prefill", "tokens": 104, "fused_decode": 4, "split": [2, 0]}
    record = StepRecord.from_json(fused)
    assert (record.decode_rows, record.prefill_tokens, record.units) == (4, 100, 2)
    single = {"time": 1.0, "lane": "hybrid", "split": [2, 2], "batch_size": 5, "tokens": 68}
    single |= {"prefill_tokens": 64, "decode_seqs": 4, "state": state, "measured_s": 0.1}
    assert StepRecord.from_json(single).decode_rows == 4


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"time": 1.0, "lane": "prefill"}\n')
    with pytest.raises(ValueError, match="steps.jsonl:1: not a step-log line"):
        read_step_log(path)
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_step_log(path)


def _step(end: float, seconds: float, lane: str, decode_rows: int) -> StepRecord:
    return StepRecord(end, lane, (1, 1), 1, 1, 0 if decode_rows else 64, decode_rows,
                      ExecutionState(), seconds)  # fmt: skip


def test_the_decode_busy_share_counts_overlapping_decode_steps_once():
    records = [
        _step(1.0, 1.0, "prefill", 0),  # 0-1 s: a prompt alone
        _step(3.0, 1.0, "decode", 8),  # 2-3 s, after a gap of 1 s on the host
        _step(3.5, 1.0, "hybrid", 4),  # 2.5-3.5 s, overlapping the last by 0.5 s
        _step(5.0, 0.5, "decode", 8),  # 4.5-5 s
    ]
    assert decode_busy_share(records) == pytest.approx((1.5 + 0.5) / 5.0)
    with pytest.raises(ValueError, match="empty step log"):
        decode_busy_share([])
