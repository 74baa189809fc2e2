"""The result file: per-request records, per-rate runs and the whole benchmark, as JSON.

The schema is shared with the simulator: a simulated result sets `simulated: true` and names
the modeled `hardware`; everything else (records, summaries) has the same shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "bulletserve.bench/1"


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds.

    `arrival_s` and `start_s` are offsets from the start of the run (when the request was due,
    and when it was actually sent, later under --max-concurrency). `token_times_s` are offsets
    from `start_s` of each streamed chunk that carried output; the first is the TTFT.
    """

    index: int
    input_len: int
    max_tokens: int
    arrival_s: float
    start_s: float = 0.0
    output_len: int = 0
    ttft_s: float | None = None
    e2el_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    success: bool = False
    error: str | None = None
    slo_class: str | None = None  # its class in a mixed workload (--service-class)

    @property
    def itls_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive streamed chunks (vLLM's ITL)."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass
class RunResult:
    """One load level: the request rate it ran at, its summary and every request."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    summary: dict[str, Any]
    requests: list[RequestRecord]


@dataclass
class BenchResult:
    """A benchmark: one run per request rate, with the configuration that produced it."""

    label: str
    config: dict[str, Any]
    runs: list[RunResult]
    simulated: bool = False
    hardware: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: infinite rates become the string "inf" (strict JSON has no Infinity)."""
        return _finite({"schema": SCHEMA, **asdict(self)})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")

    @property
    def display_label(self) -> str:
        """The label plots and tables show: simulated results say so, with their hardware."""
        if not self.simulated:
            return self.label
        return f"{self.label} (simulated{', ' + self.hardware if self.hardware else ''})"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def load_result(path: Path) -> BenchResult:
    """Read a result file written by `bullet bench` (or the simulator); ValueError if it is not."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a benchmark result ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f'{path}: not a bullet bench result (expected "schema": "{SCHEMA}")')
    try:
        runs = [
            RunResult(
                request_rate=float(run["request_rate"]),
                burstiness=float(run["burstiness"]),
                max_concurrency=run.get("max_concurrency"),
                duration_s=float(run["duration_s"]),
                summary=run["summary"],
                requests=[RequestRecord(**record) for record in run["requests"]],
            )
            for run in data["runs"]
        ]
        return BenchResult(
            label=str(data["label"]),
            config=data.get("config", {}),
            runs=runs,
            simulated=bool(data.get("simulated", False)),
            hardware=data.get("hardware"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed bullet bench result ({exc!r})") from None
