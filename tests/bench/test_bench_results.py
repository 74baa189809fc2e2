"""Result files, the comparison table, plots, and the CLI's handling of bad input."""

from __future__ import annotations

import json
import math
import socket

import pytest

from bulletserve.bench.plots import plot_results
from bulletserve.bench.records import BenchResult, RequestRecord, RunResult, load_result
from bulletserve.bench.report import compare_table, summary_table
from bulletserve.bench.serving_metrics import summarize
from bulletserve.cli import main
from bulletserve.sched.slo import SLO


def _run(rate: float, ttft: float) -> RunResult:
    records = [
        RequestRecord(
            index=i,
            input_len=100,
            max_tokens=3,
            arrival_s=i / 10,
            start_s=i / 10,
            output_len=3,
            ttft_s=ttft,
            e2el_s=ttft + 0.2,
            token_times_s=[ttft, ttft + 0.1, ttft + 0.2],
            success=True,
        )
        for i in range(10)
    ]
    records.append(RequestRecord(10, 100, 3, 1.0, error="ReadError: dropped"))
    summary = summarize(records, 2.0, SLO(3.0, 150.0), {"ttft": 500})
    return RunResult(rate, 1.0, None, 2.0, summary, records)


def _result(label: str, ttft: float, simulated: bool = False) -> BenchResult:
    return BenchResult(
        label=label,
        config={"dataset": "random", "request_rates": [2.0, math.inf]},
        runs=[_run(2.0, ttft), _run(4.0, ttft * 2), _run(math.inf, ttft * 4)],
        simulated=simulated,
        hardware="A100-80GB" if simulated else None,
    )


def test_json_round_trip_is_strict_json(tmp_path):
    path = tmp_path / "r.json"
    _result("bulletserve", 0.1).save(path)
    data = json.loads(path.read_text())  # strict: no Infinity
    assert data["schema"] == "bulletserve.bench/1" and data["simulated"] is False
    assert data["runs"][2]["request_rate"] == "inf"
    assert data["runs"][0]["requests"][10]["error"] == "ReadError: dropped"
    loaded = load_result(path)
    assert math.isinf(loaded.runs[2].request_rate)
    assert loaded.runs[0].requests[3].token_times_s == pytest.approx([0.1, 0.2, 0.3])
    assert loaded.runs[0].summary == json.loads(json.dumps(_run(2.0, 0.1).summary))


def test_load_rejects_other_files(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="other.json: not a bullet bench result"):
        load_result(path)


def test_summary_table_reports_failures():
    text = summary_table(_run(2.0, 0.1))
    assert "Failed requests:" in text and "1 x ReadError: dropped" in text
    assert "SLO attainment (%):" in text


def test_compare_table_has_ratios():
    text = compare_table([_result("a", 0.1), _result("b", 0.2, simulated=True)])
    assert "request rate 2" in text and "request rate inf" in text
    assert "b (simulated, A100-80GB) / a" in text
    line = next(row for row in text.splitlines() if row.startswith("Mean TTFT (ms)"))
    assert line.split()[-1] == "2.00x"


def test_plots_are_written_for_measured_and_simulated(tmp_path):
    files = plot_results([_result("a", 0.1), _result("b", 0.2, simulated=True)], tmp_path)
    names = sorted(path.name for path in files)
    assert names == sorted(
        ["attainment.png", "throughput.png", "p90_ttft.png", "p90_tpot.png",
         "latency_cdf.png", "ttft_timeline.png"]
    )  # fmt: skip
    assert all(path.stat().st_size > 1000 for path in files)


def test_cli_compare_and_plot(tmp_path, capsys):
    _result("a", 0.1).save(tmp_path / "a.json")
    _result("b", 0.3).save(tmp_path / "b.json")
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "3.00x" in capsys.readouterr().out
    assert main(["bench", "plot", str(tmp_path / "a.json"), "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "attainment.png").exists()
    assert main(["bench", "compare", str(tmp_path / "missing.json")]) == 2


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_is_one_clear_message(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["bench", "--base-url", url, "--num-prompts", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bullet bench: error: cannot reach a server at {url}")
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--goodput", "ttft:abc"], "--goodput expects KEY:MS"),
        (["--goodput", "latency:5"], "--goodput keys are"),
        (["--request-rates", "2,x"], "request rates must be numbers"),
        (["--request-rate", "0"], "request rates must be positive"),
        (["--dataset", "random", "--slo-tpot-ms", "50"], "give both"),
    ],
)
def test_bad_flags(capsys, flags, message):
    assert main(["bench", "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err


def test_sweep_plots_start_their_y_axis_at_zero(tmp_path, monkeypatch):
    """An axis fitted to the data drew 13.02 to 13.13 tok/s as a steep rise."""
    import matplotlib.pyplot as plt

    bottoms: list[float] = []
    real_savefig = plt.Figure.savefig

    def recording(fig, *args, **kwargs):
        bottoms.extend(ax.get_ylim()[0] for ax in fig.axes)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", recording)
    result = BenchResult("flat", {}, [_run(1.0, 0.1), _run(2.0, 0.1)])
    plot_results([result], tmp_path)
    assert len(bottoms) >= 4 and all(bottom == 0 for bottom in bottoms[:4])
