"""One step as the step log (`--step-log`) records it: the single-lane engine's, a lane's of the
laned engine, and the simulator's alike."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from bulletserve.perf.execution_state import ExecutionState

Lane = Literal["prefill", "decode"]  # the laned executor's two lanes
StepLane = Literal["prefill", "decode", "hybrid"]
STEP_LANES: tuple[StepLane, ...] = ("prefill", "decode", "hybrid")


@dataclass(frozen=True)
class StepRecord:
    """`time`: when the step ended (monotonic seconds; simulated seconds in the simulator).
    `lane`: the laned executor's lane, or for one lane what the step held (`hybrid`: prompt
    chunks and decode rows). `split`: the units per lane in force when the step started (a
    single-lane step gives every unit to the phases it ran), `rule` the bullet rule that chose
    it; `units` what the step ran on. `prefill_tokens` and `decode_rows`: prompt tokens and
    decode rows computed (a fused prefill step's rows included). `state`: what ran while it
    stepped, as the performance model takes it. `runner_s`: the model's own time within the
    step (the engine's). `layers`: a lane prefill step's layer range. `draft_tokens` and
    `accepted_tokens`: under speculative decoding, the drafts its decode rows verified and those
    the model accepted; `propose_s` the proposer's seconds for them before the step was planned
    (the engine's)."""

    time: float
    lane: StepLane
    split: tuple[int, int]
    units: int
    batch_size: int
    prefill_tokens: int
    decode_rows: int
    state: ExecutionState
    measured_s: float
    rule: str | None = None
    predicted_s: float | None = None
    runner_s: float | None = None
    layers: tuple[int, int] | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    propose_s: float | None = None

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows

    @property
    def started(self) -> float:
        return self.time - self.measured_s

    def to_json(self) -> dict:
        record = {
            "time": self.time,
            "lane": self.lane,
            "split": list(self.split),
            "rule": self.rule,
            "units": self.units,
            "batch_size": self.batch_size,
            "tokens": self.tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_rows": self.decode_rows,
            "layers": list(self.layers) if self.layers is not None else None,
            "state": self.state.to_json(),
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "runner_s": self.runner_s,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "propose_s": self.propose_s,
        }
        return {k: v for k, v in record.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict) -> StepRecord:
        """A step-log line. Logs written before `decode_rows` (up to 23ed970, which docs/ still
        links) name the rows `fused_decode` or `decode_seqs`, or count a decode lane's rows as
        its tokens, and leave out a lane step's units."""
        lane, split = data["lane"], tuple(data["split"])
        if lane not in STEP_LANES:
            raise ValueError(f"unknown lane {lane!r}")
        rows = data.get("decode_rows", data.get("fused_decode", data.get("decode_seqs")))
        if rows is None:
            rows = data["tokens"] if lane == "decode" else 0
        prefill_tokens = data.get("prefill_tokens", data["tokens"] - rows)
        units = data.get("units", split[0] if lane == "prefill" else split[1])
        layers = data.get("layers")
        return cls(
            time=float(data["time"]),
            lane=lane,
            split=(int(split[0]), int(split[1])),
            units=int(units),
            batch_size=int(data["batch_size"]),
            prefill_tokens=int(prefill_tokens),
            decode_rows=int(rows),
            state=ExecutionState.from_json(data["state"]),
            measured_s=float(data["measured_s"]),
            rule=data.get("rule"),
            predicted_s=data.get("predicted_s"),
            runner_s=data.get("runner_s"),
            layers=(int(layers[0]), int(layers[1])) if layers is not None else None,
            draft_tokens=data.get("draft_tokens"),
            accepted_tokens=data.get("accepted_tokens"),
            propose_s=data.get("propose_s"),
        )


def decode_busy_share(records: list[StepRecord]) -> float:
    """The share of the log's span (the first step's start to the last step's end) in which a
    step computing decode rows ran: how much of the time the device was decoding rather than
    waiting on the host, prompts alone, or idle. Overlapping steps count once."""
    if not records:
        raise ValueError("an empty step log has no span")
    span = max(r.time for r in records) - min(r.started for r in records)
    intervals = sorted((r.started, r.time) for r in records if r.decode_rows > 0)
    busy, reached = 0.0, float("-inf")
    for start, end in intervals:
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / span if span > 0 else 0.0


def write_step(handle: IO[str], record: StepRecord) -> None:
    """Append one line (the caller flushes: the engine per step, the simulator at the end)."""
    handle.write(json.dumps(record.to_json()) + "\n")


def read_step_log(path: Path) -> list[StepRecord]:
    """Every record of a step log, in file order; a clear error naming the line that is not
    one."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(StepRecord.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, IndexError):
            raise ValueError(
                f"{path}:{number}: not a step-log line (expected JSON with time, lane, split, "
                "batch_size, tokens, state, measured_s)"
            ) from None
    if not records:
        raise ValueError(f"{path}: the step log is empty")
    return records
