"""Prometheus metrics, named like vLLM's with a `bullet:` prefix; those vLLM has are also
exported under its own `vllm:` names, so that dashboards built for vLLM work unchanged.

Latency histograms are observed when a request finishes; the queue, KV-cache and preemption
figures are read from the engine at scrape time. Each server has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bulletserve.engine.client import EngineClient
from bulletserve.engine.request import RequestOutput
from bulletserve.sched.slo import SLO, ServiceClass
from bulletserve.spec.counters import SpecCounters

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and counters that the engine already keeps (`EngineClient.stats`)."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = [self.model_name]
        healthy = GaugeMetricFamily(
            "bullet:engine_healthy",
            "1 while the engine serves, 0 once it has died.",
            labels=["model_name"],
        )
        healthy.add_metric(labels, float(self.engine.healthy))
        yield healthy
        if not self.engine.healthy:
            return  # a dead engine's last figures are not live: none are reported
        stats = self.engine.stats()
        families = [
            (
                "bullet:num_requests_running",
                "Requests admitted and not finished (both lanes under bullet).",
                stats.num_running,
            ),
            ("bullet:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("bullet:kv_cache_blocks_used", "KV-cache blocks in use.", stats.kv_blocks_used),
            ("bullet:kv_cache_blocks_total", "KV-cache blocks in the pool.", stats.kv_blocks_total),
            (
                "bullet:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
                stats.kv_blocks_used / max(1, stats.kv_blocks_total),
            ),
        ]
        for name, documentation, value in families:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        by_class = GaugeMetricFamily(
            "bullet:num_requests_waiting_by_slo_class",
            "Requests waiting to be scheduled, per SLO class.",
            labels=["model_name", "slo_class"],
        )
        for name, count in sorted(stats.waiting_by_class.items()):
            by_class.add_metric([self.model_name, name], count)
        yield by_class
        for name, documentation, value in (
            (
                "bullet:num_preemptions",
                "Requests preempted (KV blocks freed, to recompute).",
                stats.num_preemptions,
            ),
            (
                "bullet:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (at first admission).",
                stats.prefix_cache_queries,
            ),
            (
                "bullet:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (at first admission).",
                stats.prefix_cache_hits,
            ),
        ):
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        if stats.spec is not None:
            yield from _spec_counters(stats.spec, self.model_name)
        if stats.max_loras is not None:
            # vLLM's: the adapters with requests running and waiting in its labels, its value
            # when they were read.
            adapters = GaugeMetricFamily(
                "bullet:lora_requests_info",
                "Running stats on LoRA requests.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            adapters.add_metric(
                [
                    ",".join(sorted(stats.running_loras)),
                    ",".join(sorted(stats.waiting_loras)),
                    str(stats.max_loras),
                ],
                time.time(),
            )
            yield adapters
        if stats.lane_units:
            units = GaugeMetricFamily(
                "bullet:lane_units", "Compute units (SMs or CPU threads) each lane has now.",
                labels=["model_name", "lane"],
            )  # fmt: skip
            error = GaugeMetricFamily(
                "bullet:step_prediction_error",
                "|predicted / measured - 1| of each lane's last step.",
                labels=["model_name", "lane"],
            )
            for lane, (count, last_error) in stats.lane_units.items():
                units.add_metric([self.model_name, lane], count)
                if last_error is not None:
                    error.add_metric([self.model_name, lane], last_error)
            yield units
            yield error
        if stats.step_times:
            families = [
                GaugeMetricFamily(
                    f"bullet:step_{which}_seconds",
                    f"Running mean of recent steps' {which} seconds, per step kind (prefill, "
                    "fused, decode): the performance model's predictions against the device.",
                    labels=["model_name", "kind"],
                )
                for which in ("predicted", "measured")
            ]
            for kind, times in stats.step_times.items():
                for family, seconds in zip(families, times, strict=True):
                    family.add_metric([self.model_name, kind], seconds)
            yield from families


def _spec_counters(spec: SpecCounters, model_name: str) -> Iterator[Metric]:
    """Speculative decoding's counters, as vLLM names them."""
    for name, documentation, value in (
        ("num_drafts", "Verified decode rows that carried drafts.", spec.num_drafts),
        ("num_draft_tokens", "Drafted tokens verified.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Drafted tokens the model accepted.", spec.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(
            f"bullet:spec_decode_{name}", documentation, labels=["model_name"]
        )
        counter.add_metric([model_name], value)
        yield counter
    per_position = CounterMetricFamily(
        "bullet:spec_decode_num_accepted_tokens_per_pos",
        "Drafted tokens accepted, per position in the draft (0 first).",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(spec.accepted_per_position):
        per_position.add_metric([model_name, str(position)], count)
    yield per_position


# Our metrics that vLLM exports too, under the same name with its `vllm:` prefix.
VLLM_NAMES = frozenset(
    {
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
        "time_to_first_token_seconds", "time_per_output_token_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds", "prompt_tokens",
        "generation_tokens", "request_success", "prefix_cache_queries", "prefix_cache_hits",
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
        "lora_requests_info",
    }
)  # fmt: skip


class _VLLMAliases(Collector):
    """Every metric of `registry` that vLLM has, again under vLLM's name."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            bare = metric.name.removeprefix("bullet:")
            if bare not in VLLM_NAMES:
                continue
            alias = Metric(f"vllm:{bare}", metric.documentation, metric.type)
            alias.samples = [
                sample._replace(name="vllm:" + sample.name.removeprefix("bullet:"))
                for sample in metric.samples
            ]
            yield alias


class ServerMetrics:
    def __init__(
        self, engine: EngineClient, model_name: str, default_slo: SLO | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

        self.ttft = histogram(
            "bullet:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.tpot = histogram(
            "bullet:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _TPOT_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "bullet:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.queue = histogram(
            "bullet:request_queue_time_seconds",
            "Arrival to first scheduled step.",
            _LATENCY_BUCKETS,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "bullet:prompt_tokens", "Prompt tokens of finished requests.", labels,
            registry=self.registry,
        ).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter(
            "bullet:generation_tokens", "Generated tokens (finished and aborted requests).",
            labels, registry=self.registry,
        ).labels(model_name)  # fmt: skip
        self._finished = Counter(
            "bullet:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        slo_labels = ["model_name", "slo_class"]
        self._slo_requests = Counter(
            "bullet:slo_requests", "Finished requests, per SLO class.", slo_labels,
            registry=self.registry,
        )  # fmt: skip
        self._slo_met = Counter(
            "bullet:slo_met",
            "Finished requests per SLO class that met their TTFT target, their TPOT target, and "
            "both (the class's attainment: both over bullet:slo_requests).",
            [*slo_labels, "target"],
            registry=self.registry,
        )
        self._shed = Counter(
            "bullet:requests_shed",
            "Requests shed (429) after waiting past --max-queue-delay-ms, per SLO class.",
            slo_labels,
            registry=self.registry,
        )
        self.default_slo = default_slo

    def observe(self, output: RequestOutput, service: ServiceClass = ServiceClass()) -> None:
        """Record a request that ended (finished or aborted), against its class's SLO."""
        timings = output.timings
        self.generation_tokens.inc(len(output.token_ids))
        if output.finish_reason == "shed":  # a miss of its class's SLO
            self._slo_requests.labels(self.model_name, service.name).inc()
            self._shed.labels(self.model_name, service.name).inc()
            return
        if not output.finished or output.finish_reason == "abort":
            return
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self._finished.labels(self.model_name, output.finish_reason or "stop").inc()
        if timings.first_scheduled is not None:
            self.queue.observe(timings.first_scheduled - timings.arrival)
        if timings.first_token is not None:
            self.ttft.observe(timings.first_token - timings.arrival)
            if timings.finished is not None:
                self.e2e.observe(timings.finished - timings.arrival)
                if len(output.token_ids) > 1:
                    decode_time = timings.finished - timings.first_token
                    self.tpot.observe(decode_time / (len(output.token_ids) - 1))
        slo = service.slo or self.default_slo
        if slo is None or timings.first_token is None or timings.finished is None:
            return
        ttft_met = timings.first_token - timings.arrival <= slo.ttft_s(len(output.prompt_token_ids))
        outputs = len(output.token_ids)
        tpot = (timings.finished - timings.first_token) / (outputs - 1) if outputs > 1 else 0.0
        tpot_met = tpot <= slo.tpot_s
        self._slo_requests.labels(self.model_name, service.name).inc()
        for target, met in (
            ("ttft", ttft_met),
            ("tpot", tpot_met),
            ("both", ttft_met and tpot_met),
        ):
            if met:
                self._slo_met.labels(self.model_name, service.name, target).inc()

    def render(self) -> bytes:
        aliases = CollectorRegistry()
        aliases.register(_VLLMAliases(self.registry))
        return generate_latest(self.registry) + generate_latest(aliases)
