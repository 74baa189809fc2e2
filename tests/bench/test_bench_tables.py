"""`bullet bench merge|table|misses`: tables from result files, and one result per label from
several sweeps, reruns replacing runs."""

from __future__ import annotations

import dataclasses

from bulletserve.bench.records import load_result
from bulletserve.cli import main
from bulletserve.sched.slo import SLO
from bulletserve.sim.benchmark import SimConfig, simulate


def _result(label: str, rates: tuple[float, ...], seed: int):
    config = SimConfig(
        hardware="a100-80g",
        model="llama-3.1-8b",
        policy="chunked",
        chunked_prefill_size=512,
        num_prompts=8,
        request_rates=rates,
        slo=SLO(3.0, 150.0),
        seed=seed,
    )
    return dataclasses.replace(simulate(config), label=label)


def test_runs_merge_by_label_and_a_later_file_replaces_a_rate(tmp_path):
    first = _result("chunked-512", (1.0, 2.0), seed=0)
    rerun = _result("chunked-512", (2.0, 3.0), seed=1)
    other = _result("prefill-first", (1.0,), seed=0)
    paths = []
    for name, result in (("a", first), ("b", rerun), ("c", other)):
        paths.append(tmp_path / f"{name}.json")
        result.save(paths[-1])
    out = tmp_path / "merged"
    assert main(["bench", "merge", *map(str, paths), "--out", str(out)]) == 0
    merged = load_result(out / "chunked-512.json")
    assert [run.request_rate for run in merged.runs] == [1.0, 2.0, 3.0]
    assert merged.runs[0].summary == first.runs[0].summary
    assert merged.runs[1].summary == rerun.runs[0].summary  # the rerun's 2.0
    sources = {"1": str(paths[0]), "2": str(paths[1]), "3": str(paths[1])}
    assert merged.config["merged_from"] == sources
    assert [run.request_rate for run in load_result(out / "prefill-first.json").runs] == [1.0]


def test_a_sweep_table_and_its_misses(tmp_path, capsys):
    result = _result("chunked-512", (1.0, 2.0), seed=0)
    rerun = dataclasses.replace(_result("chunked-512", (2.0,), seed=1), label="chunked-512")
    both = dataclasses.replace(result, runs=[*result.runs, *rerun.runs])
    path = tmp_path / "chunked-512.json"
    both.save(path)
    assert main(["bench", "table", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| chunked-512 |")]
    assert [row.split("|")[2].strip() for row in rows[:2]] == ["1", "2"]
    assert "Rates run more than once" in out
    assert rows[-1] == "| chunked-512 | 2.0 | 2.0 |"  # every rate keeps 90% at these SLOs
    assert main(["bench", "table", str(path), "--slo", "0,0.001,0.001"]) == 0
    assert "none tested" in capsys.readouterr().out  # nothing meets SLOs that tight
    assert main(["bench", "table", str(path), "--slo", "1,2"]) == 2
    assert "--slo" in capsys.readouterr().err
    assert main(["bench", "misses", str(path)]) == 0
    misses = capsys.readouterr().out.splitlines()
    assert misses[0].startswith("| config | rate | requests |") and len(misses) == 2 + 3


def test_a_run_made_without_slos_is_tabled_without_attainment(tmp_path, capsys):
    """`bench table` prints such a run's throughput and latency (attainment left out) and
    `bench misses`, which is about SLOs alone, names --slo; both score it at the SLOs it
    gives."""
    result = _result("chunked-512", (1.0,), seed=0)
    for run in result.runs:
        del run.summary["slo"]
    path = tmp_path / "no-slo.json"
    result.save(path)
    assert main(["bench", "table", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| config | rate | completed (req/s) | output tok/s |")
    assert "| chunked-512 | 1 |" in out and "attainment |" not in out
    assert main(["bench", "misses", str(path)]) == 2
    assert "--slo" in capsys.readouterr().err
    for action in ("table", "misses"):
        assert main(["bench", action, str(path), "--slo", "0,3,150"]) == 0
        assert "| chunked-512 | 1 |" in capsys.readouterr().out


def test_the_sdks_base_url_form_names_the_same_server():
    from bulletserve.bench.http_client import server_root

    for given in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert server_root(given) == "http://h:8000"
