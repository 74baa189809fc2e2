"""scripts/merge_results.py: one result per label from several sweeps, reruns replacing runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

from bulletserve.bench.metrics import SLO
from bulletserve.bench.records import load_result
from bulletserve.sim.runner import SimConfig, simulate

SCRIPT = Path(__file__).parents[2] / "scripts" / "merge_results.py"


def _script():
    spec = importlib.util.spec_from_file_location("merge_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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


def test_runs_merge_by_label_and_a_later_file_replaces_a_rate(tmp_path, monkeypatch):
    first = _result("chunked-512", (1.0, 2.0), seed=0)
    rerun = _result("chunked-512", (2.0, 3.0), seed=1)
    other = _result("prefill-first", (1.0,), seed=0)
    paths = []
    for name, result in (("a", first), ("b", rerun), ("c", other)):
        paths.append(tmp_path / f"{name}.json")
        result.save(paths[-1])
    out = tmp_path / "merged"
    monkeypatch.setattr(sys, "argv", ["merge_results", *map(str, paths), "--out", str(out)])
    _script().main()
    merged = load_result(out / "chunked-512.json")
    assert [run.request_rate for run in merged.runs] == [1.0, 2.0, 3.0]
    assert merged.runs[0].summary == first.runs[0].summary
    assert merged.runs[1].summary == rerun.runs[0].summary  # the rerun's 2.0
    sources = {"1": str(paths[0]), "2": str(paths[1]), "3": str(paths[1])}
    assert merged.config["merged_from"] == sources
    assert [run.request_rate for run in load_result(out / "prefill-first.json").runs] == [1.0]
