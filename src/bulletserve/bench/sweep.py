"""A whole benchmark: connect, build the workload once, run it at each request rate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from transformers import PreTrainedTokenizerBase

from bulletserve.bench.arrivals import arrival_times, trace_arrival_times
from bulletserve.bench.classes import WorkloadClass, assign_classes
from bulletserve.bench.datasets import RandomLengths, WorkloadRequest, load_workload
from bulletserve.bench.http_client import Target, list_models, make_client
from bulletserve.bench.load import LoadLevel, run_level
from bulletserve.bench.records import BenchResult, RunResult
from bulletserve.sched.slo import SLO


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run depends on; written into the result file as `config`."""

    base_url: str
    dataset: str
    num_prompts: int
    request_rates: tuple[float, ...]
    endpoint: str = "completions"
    model: str | None = None
    tokenizer: str | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = None  # None: the server's default
    max_model_len: int | None = None
    random_lengths: RandomLengths = field(default_factory=RandomLengths)
    trace_arrivals: bool = False
    slo: SLO | None = None
    goodput_ms: dict[str, float] | None = None
    # A mixed workload: its classes (shares of the requests, each its SLO and priority), and
    # whether requests send their class's priority and SLO class name.
    service_classes: tuple[WorkloadClass, ...] = ()
    send_priority: bool = False
    send_slo: bool = False
    lora_modules: tuple[str, ...] = ()  # names the requests take in turn (vLLM's --lora-modules)
    label: str | None = None
    api_key: str | None = field(default=None, repr=False)
    request_timeout_s: float = 600.0


async def run_benchmark(
    config: BenchConfig,
    tokenizer: PreTrainedTokenizerBase,
    progress: bool = True,
    on_run: Callable[[RunResult], None] | None = None,
) -> BenchResult:
    """Run the sweep; ServerUnreachable if no server answers, DatasetError for a bad dataset."""
    async with make_client(config.max_concurrency, config.request_timeout_s) as client:
        models = await list_models(client, config.base_url, config.api_key)
        served = models[0] if models else {}
        model = config.model or served.get("id")
        if not model:
            raise ValueError(f"{config.base_url} lists no model; pass --model")
        max_model_len = config.max_model_len or served.get("max_model_len")
        workload = await asyncio.to_thread(
            load_workload,
            config.dataset,
            config.num_prompts,
            tokenizer,
            config.seed,
            max_model_len,
            config.random_lengths,
        )
        target = Target(
            config.base_url,
            model,
            config.endpoint,
            config.api_key,
            config.ignore_eos,
            config.temperature,
            config.send_priority,
            config.send_slo,
            config.lora_modules,
        )
        classes = (
            assign_classes(len(workload), list(config.service_classes), config.seed)
            if config.service_classes
            else []
        )

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        runs = []
        for rate in config.request_rates:
            level = LoadLevel(rate, config.burstiness, config.max_concurrency)
            run = await run_level(
                client,
                target,
                workload,
                _arrivals(config, workload, rate),
                level,
                count_tokens,
                config.slo,
                config.goodput_ms,
                progress,
                classes,
            )
            runs.append(run)
            if on_run:
                on_run(run)
    label = config.label or served.get("owned_by") or urlparse(config.base_url).netloc
    settings = asdict(config)
    settings.pop("api_key")
    settings.update(
        model=model,
        max_model_len=max_model_len,
        tokenizer=config.tokenizer or "default (SmolLM2-135M-Instruct)",
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    return BenchResult(label=label, config=settings, runs=runs)


def _arrivals(config: BenchConfig, workload: list[WorkloadRequest], rate: float) -> list[float]:
    if config.trace_arrivals:
        stamps = [w.timestamp for w in workload]
        if any(t is None for t in stamps):
            raise ValueError(f"--trace-arrivals: dataset {config.dataset} has no timestamps")
        return trace_arrival_times([t for t in stamps if t is not None], rate)
    return arrival_times(len(workload), rate, config.burstiness, config.seed)
