"""`bullet simulate` end to end: the result file is a bench result that compare and plot take."""

from __future__ import annotations

import json

import pytest

from bulletserve.bench.records import load_result
from bulletserve.cli import main


def test_simulate_writes_a_bench_result_that_compare_and_plot_take(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
            "--hardware", "h100", "--model", "llama-3.1-8b", "--policy", "bullet",
            "--partition", "static:64/68", "--dataset", "sharegpt-like",
            "--num-prompts", "30", "--request-rates", "5,10",
            "--output", str(out), "--plot", str(tmp_path / "plots"),
            "--step-log", str(tmp_path / "steps.jsonl"),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out  # simulated seconds are named so, not a benchmark's
    assert "Simulated Serving Result" in printed and "Simulated duration (s)" in printed
    assert "Benchmark" not in printed
    result = load_result(out)
    assert result.simulated and result.hardware == "H100-SXM"
    assert result.label == "bullet-static:64/68"
    assert [r.request_rate for r in result.runs] == [5, 10]
    assert result.runs[0].summary["slo"]["tpot_ms"] == 150.0  # the paper's ShareGPT SLO
    assert (tmp_path / "steps-rate5.jsonl").exists() and (tmp_path / "steps-rate10.jsonl").exists()
    assert (tmp_path / "plots" / "throughput.png").exists()
    capsys.readouterr()
    assert main(["bench", "compare", str(out)]) == 0
    assert "simulated, H100-SXM" in capsys.readouterr().out


def test_user_errors_are_one_line(capsys):
    assert main(["simulate", "--hardware", "tpu", "--model", "tiny"]) == 2
    assert "not a preset" in capsys.readouterr().err
    args = ["simulate", "--hardware", "a100-80g", "--model", "llama-3.1-8b"]
    assert main([*args, "--policy", "bullet", "--partition", "static:3/3"]) == 2
    assert "P + D must equal" in capsys.readouterr().err
    assert main([*args, "--dataset", "sharegpt:/x.json"]) == 2
    assert "sharegpt-like" in capsys.readouterr().err
    assert main([*args, "--policy", "bullet", "--dataset", "random"]) == 2
    assert "SLOs" in capsys.readouterr().err


def test_simulate_a_tensor_parallel_model(capsys):
    args = ["simulate", "--hardware", "a100-80g", "--model", "llama-3.1-70b", "--policy"]
    args += ["chunked", "--dataset", "sharegpt-like", "--num-prompts", "20", "--request-rate", "4"]
    assert main([*args, "--tensor-parallel-size", "8"]) == 0
    assert "SLO attainment" in capsys.readouterr().out
    assert main([*args, "--tensor-parallel-size", "3"]) == 2  # 64 heads do not split in 3
    assert "does not divide" in capsys.readouterr().err
    assert main([*args[:2], "h200", *args[3:], "-tp", "8"]) == 2
    assert "no all-reduce times for 8 ranks" in capsys.readouterr().err


def test_simulate_a_quantized_model(tmp_path):
    """`bullet simulate --quantization`: the same load, served faster where decode reads fewer
    bytes (Llama-3.1-8B on the H200 preset, decode-heavy lengths), and an unknown format named."""
    tpots = {}
    for quantization in (None, "q4_k"):
        out = tmp_path / f"{quantization}.json"
        argv = ["simulate", "--hardware", "h200", "--model", "llama-3.1-8b", "--dataset"]
        argv += ["random", "--input-len", "128", "--output-len", "256", "--num-prompts", "60"]
        argv += ["--request-rate", "4", "--output", str(out)]
        assert main(argv + (["--quantization", quantization] if quantization else [])) == 0
        (run,) = json.loads(out.read_text())["runs"]
        tpots[quantization] = run["summary"]["tpot_ms"]["mean"]
    assert tpots["q4_k"] < 0.6 * tpots[None]
    with pytest.raises(SystemExit):
        main(["simulate", "--quantization", "q3_k"])
