"""One lane (chunked, prefill-first): each `step()` takes in new requests, asks the policy for
a plan, runs its batch (prompt chunks and decode rows together) on every unit and samples the
requests it brought to their next token.

Under --async-scheduling a step is a pipeline of two: step N+1 is planned, its inputs built
and its forward launched while step N still runs on the device, N+1's decode rows taking N's
tokens from N's draw on the device; until N is read back each such token is pending in its
request (counted, so the plan schedules its row; not yet in the output). N is read back while
N+1's forward runs and before N+1 draws, so that a draw that reads its request's output (a
grammar, penalties) sees all of it; a request N's token ended has run one row too many in N+1,
which draws nothing for it. A plan that preempts waits for N to be read back and is made again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import torch

from bulletserve.bookkeeping.clock import Clock
from bulletserve.bookkeeping.record import write_step
from bulletserve.bookkeeping.single_step import (
    SingleStep,
    begin_single_step,
    end_single_step,
    scheduler_snapshot,
)
from bulletserve.engine.model_runner import FedTokens, SeqWork, request_work
from bulletserve.engine.parts import EngineParts
from bulletserve.engine.pricing import hardware_profile, perf_model
from bulletserve.engine.request import Request, RequestOutput, RequestState
from bulletserve.engine.sampler import Draw
from bulletserve.engine.speculation import Speculator
from bulletserve.model.decoder import LogitsBuffer
from bulletserve.partition import lane_units
from bulletserve.perf.model import PerfModel
from bulletserve.sched import make_policy
from bulletserve.sched.base import Policy, SchedulerSnapshot, StepPlan
from bulletserve.sched.drafts import DraftRule
from bulletserve.spec.counters import SpecCounters

logger = logging.getLogger(__name__)


class DeviceTimer:
    """Where a GPU's steps start and end on the host's clock: events recorded around each
    step's kernels, placed against one reference event whose host time is known, and read once
    the step is done; so timing steps for the step log never waits for them."""

    def __init__(self, clock: Clock) -> None:
        self._reference = torch.cuda.Event(enable_timing=True)
        self._reference.record()
        self._reference.synchronize()
        self._reference_time = clock.now()

    def mark(self) -> torch.cuda.Event:
        """An event behind the kernels launched so far."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def at(self, event: torch.cuda.Event) -> float:
        """When the device reached `event` (waiting for it), on the host's clock."""
        event.synchronize()
        return self._reference_time + self._reference.elapsed_time(event) / 1e3


@dataclass
class InFlight:
    """A step launched and not yet read back: its bookkeeping and works, the requests it draws
    a token for (in its rows' order) and the draw; its forward's end and seconds as the clock
    measured them (a CPU's, which computes as it launches), and on a GPU the events around it."""

    step: SingleStep[Request]
    works: list[SeqWork]
    sampled: list[Request]
    draw: Draw | None
    ended: float
    measured: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    accepted: int | None = None  # of its drafts, those accepted (speculative decoding)
    propose_s: float | None = None  # the proposer's seconds for its drafts
    predicted: float | None = None  # the performance model's seconds, where it plans by one

    def feeds(self, step: SingleStep[Request]) -> FedTokens | None:
        """The rows of `step` whose input token this step is drawing."""
        drawn = {id(request): row for row, request in enumerate(self.sampled) if request.pending}
        rows, picks = [], []
        for index, (request, _) in enumerate(step.batch):
            row = drawn.get(id(request))
            if row is not None:
                rows.append(index)
                picks.append(row)
        if not rows:
            return None
        assert self.draw is not None
        return FedTokens(rows, self.draw.tokens, picks)


class HostTime:
    """The engine's own seconds per step outside the forward (planning, drawing, handing the
    outputs over and waiting for the server to send them): from one step's start to the next's
    while requests run, less the forward; a running mean whose first values are averaged."""

    WEIGHT = 0.1

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: float | None = None
        self._forward = 0.0
        self._seen = 0

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._started is not None:
            host = max(0.0, now - self._started - self._forward)
            self._seen += 1
            self.seconds += max(self.WEIGHT, 1.0 / self._seen) * (host - self.seconds)
        self._started, self._forward = now, 0.0

    def forward_ran(self, seconds: float) -> None:
        self._forward = seconds

    def idle(self) -> None:
        """No request runs: the wait for the next one is nobody's step."""
        self._started = None


class SingleLane:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self._logits = LogitsBuffer()
        self.async_scheduling = parts.config.async_scheduling
        self._in_flight: InFlight | None = None
        device = parts.device
        # The device's units, as the step log counts them: SMs on a GPU, threads on a CPU.
        if device.type == "cuda":
            self.units = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.units = torch.get_num_threads()
        graphs = parts.runner.graphs
        if graphs is not None:
            # Every step runs on this stream: its decode graphs are captured now, not by requests.
            started = time.perf_counter()
            graphs.capture()
            logger.info("captured decode graphs in %.1f s", time.perf_counter() - started)
        self._timer = DeviceTimer(parts.clock) if parts.step_log and device.type == "cuda" else None
        self.speculator = None
        # Under speculative decoding the policy prices drafts by the performance model, its
        # online corrections fed each step's measured time.
        self.perf: PerfModel | None = None
        drafts = None
        speculation = parts.config.speculative_config
        if speculation is not None:
            self.speculator = Speculator(speculation, parts.life.max_model_len, parts.draft)
        if speculation is not None and speculation.adaptive:
            units = lane_units(device, torch.get_num_threads())
            self.perf = perf_model(
                parts, hardware_profile(parts.config.hardware_profile, units, parts.dtype)
            )
            drafts = DraftRule.from_perf(self.perf, self.units)
        self.host = HostTime()
        self.policy: Policy = make_policy(parts.config, drafts=drafts)

    def thread_counts(self) -> list[int]:
        return [torch.get_num_threads()]

    def snapshot(self) -> SchedulerSnapshot:
        parts, config = self.parts, self.parts.config
        return scheduler_snapshot(
            parts.book,
            parts.clock.now(),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.host.seconds,
            config.max_loras,
        )

    def step(self) -> list[RequestOutput]:
        """One scheduling step; outputs of requests that progressed or ended. Under
        --async-scheduling, the step is planned and launched while the last one may still run
        on the device, and the outputs are the last step's."""
        parts, life = self.parts, self.parts.life
        outputs = life.take_in()
        if self.speculator is not None:
            self.host.step_started()
            self.speculator.propose(parts.book.running)
        plan = self.policy.plan(self.snapshot())
        if self._in_flight is not None and self._waits_for_draw(plan):
            outputs += self._land_in_flight()
            plan = self.policy.plan(self.snapshot())
        step = begin_single_step(parts.book, plan)
        for request in step.preempted:
            request.state = RequestState.WAITING
        if not step.batch:
            self.host.idle()
            return outputs + self._land_in_flight()
        flight, logits = self._launch(step)
        if self.speculator is not None:  # serial steps (EngineConfig refuses it with async)
            self.host.forward_ran(flight.measured)
            outputs += self._verify(flight, logits)
            if not parts.book.running:
                self.host.idle()
            return outputs
        outputs += self._land_in_flight()
        self._draw(flight, logits)
        self._close(flight)
        self._in_flight = flight
        if not self.async_scheduling:
            outputs += self._land_in_flight()
        return outputs

    def _land_in_flight(self) -> list[RequestOutput]:
        """Read the step in flight back, if there is one (`_land`); none is in flight after."""
        flight, self._in_flight = self._in_flight, None
        return [] if flight is None else self._land(flight)

    def _waits_for_draw(self, plan: StepPlan) -> bool:
        """Whether the plan needs the step in flight read back first: it preempts (a request
        recomputes its context from tokens the host has), or it schedules a pending token as
        more than one decode row's input."""
        if plan.preempted:
            return True
        assert self._in_flight is not None
        pending = {r.request_id for r in self._in_flight.sampled if r.pending}
        return any(s.num_tokens != 1 and s.request_id in pending for s in plan.scheduled)

    def _launch(self, step: SingleStep[Request]) -> tuple[InFlight, torch.Tensor]:
        """Run the step's forward on the device: the step, and the logits of the rows that
        draw a token. A decode row whose input token the step in flight is drawing takes it
        from that step's draw."""
        parts = self.parts
        works = []
        now = parts.clock.now()
        for request, num_tokens in step.batch:
            start = request.num_computed_tokens
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            works.append(request_work(request, start, start + num_tokens))
        fed = None
        if self._in_flight is not None and self._in_flight.draw is not None:
            fed = self._in_flight.feeds(step)
        started = self._timer.mark() if self._timer is not None else None
        run = partial(parts.runner.execute, works, self._logits)
        if fed is not None:
            run = partial(run, fed=fed)
        (logits, sampling), measured = parts.clock.run_single(step, self.units, run)
        events = None
        if self._timer is not None and started is not None:
            events = (started, self._timer.mark())
        # The runner's row order (prompts of one token sit with the decode rows).
        sampled = [step.batch[i][0] for i in sampling]
        flight = InFlight(step, works, sampled, None, parts.clock.now(), measured, events)
        return flight, logits

    def _draw(self, flight: InFlight, logits: torch.Tensor) -> None:
        """Draw the step's tokens where its logits are, after the step before was read back
        (so that a draw reading its request's own output, a grammar's or a penalty's, sees
        all of it); a request that step ended draws nothing."""
        live = [row for row, request in enumerate(flight.sampled) if not request.is_finished]
        if len(live) < len(flight.sampled):
            flight.sampled = [flight.sampled[row] for row in live]
            if live:
                logits = logits[torch.tensor(live, dtype=torch.long, device=logits.device)]
        if flight.sampled:
            stop_ids = [request.stop_ids for request in flight.sampled]
            flight.draw = self.parts.sampler.draw(logits, flight.sampled, stop_ids)
            flight.draw.copy_back()

    def _close(self, flight: InFlight, rejected: dict[str, int] | None = None) -> None:
        """Count what the step computed (the host knows every token it read by now, and with
        `rejected` which drafts the model did not accept), and mark the tokens it draws as
        pending in their requests until they are read back. A request that ended meanwhile
        (its stop found in the step before, an abort) is left alone."""
        parts = self.parts
        dropped = rejected or {}
        end_single_step(
            parts.book,
            flight.step,
            lambda request: request.is_finished,
            lambda request: dropped.get(request.request_id, 0),
        )
        for (request, _), work in zip(flight.step.batch, flight.works, strict=True):
            if request.is_finished:
                continue
            if work.prompt_targets:
                request.keep_prompt_logprobs(work.start, work.prompt_logprobs)
            if not work.samples:  # a prompt's chunk short of its end
                request.state = RequestState.PREFILLING
        if rejected is None:
            for request in flight.sampled:
                request.pending = not request.is_finished

    def _verify(self, flight: InFlight, logits: torch.Tensor) -> list[RequestOutput]:
        """Under speculative decoding: draw the step's tokens position by position, each
        verified row as far as its drafts hold (`Speculator.verify`), then count what the step
        computed; the outputs of the requests it advanced."""
        parts, life = self.parts, self.parts.life
        assert self.speculator is not None
        rejected = self.speculator.verify(
            flight.sampled, logits, parts.sampler, life, parts.clock.now()
        )
        flight.accepted = flight.step.draft_tokens - sum(rejected.values())
        flight.propose_s = self.speculator.propose_s
        if self.perf is not None:
            es, phase = flight.step.execution_state(self.units)
            if parts.step_log:  # the estimate the step was planned by, for its line
                prediction = self.perf.predict(es)
                flight.predicted = (
                    prediction.prefill_s if phase == "prefill" else prediction.decode_s
                )
            self.perf.observe(es, phase, flight.measured)
        self._close(flight, rejected)
        self._log_step(flight)
        advanced = {request.request_id: request for request in flight.sampled}
        return [life.output(request) for request in advanced.values()]

    def _land(self, flight: InFlight) -> list[RequestOutput]:
        """Read the step's draw back and hand each token to its request's life; the outputs of
        the requests it advanced. A token drawn for a request that ended meanwhile is dropped."""
        parts, life = self.parts, self.parts.life
        tokens, logprobs = flight.draw.read() if flight.draw is not None else ([], [])
        self._log_step(flight)
        now = parts.clock.now()
        outputs = []
        for request, token, logprob in zip(flight.sampled, tokens, logprobs, strict=True):
            request.pending = False
            if request.is_finished:
                continue
            life.append_token(request, token, logprob, now)
            outputs.append(life.output(request))
        return outputs

    def _log_step(self, flight: InFlight) -> None:
        """The step's line in the step log, where one is written."""
        parts = self.parts
        if parts.step_log:
            ended, measured = flight.ended, flight.measured
            if self._timer is not None and flight.events is not None:
                started, ended = (self._timer.at(event) for event in flight.events)
                measured = ended - started
            es = flight.step.execution_state(self.units)[0]
            record = flight.step.record(
                ended, self.units, es, measured, flight.predicted, flight.accepted, flight.propose_s
            )
            write_step(parts.step_log, record)
            parts.step_log.flush()

    # ---- the rest of the executor interface: one lane computes only inside `step()` ---------

    def wake(self) -> None:
        pass

    def has_pending(self) -> bool:
        return self._in_flight is not None

    def num_running(self) -> int:
        return len(self.parts.book.running)

    def lane_units(self) -> dict[str, tuple[int, float | None]]:
        return {}

    def step_times(self) -> dict[str, tuple[float, float]]:
        return {}  # the one-lane policies plan without a performance model

    def spec_counters(self) -> SpecCounters | None:
        return None if self.speculator is None else self.speculator.counters.copy()

    def outputs_handed_off(self) -> None:
        pass

    def close(self) -> None:
        pass
