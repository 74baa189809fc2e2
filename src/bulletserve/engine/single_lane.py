"""One lane (chunked, prefill-first): each `step()` takes in new requests, asks the policy for
a plan, runs its batch (prompt chunks and decode rows together) on every unit and samples the
requests it brought to their next token."""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from bulletserve.bookkeeping.record import write_step
from bulletserve.bookkeeping.single import begin_single_step, end_single_step, scheduler_snapshot
from bulletserve.engine.model_runner import SeqWork, request_work
from bulletserve.engine.parts import EngineParts
from bulletserve.engine.request import RequestOutput, RequestState
from bulletserve.model.decoder import LogitsBuffer
from bulletserve.sched import make_policy
from bulletserve.sched.base import Policy, SchedulerSnapshot

logger = logging.getLogger(__name__)


class SingleLane:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.policy: Policy = make_policy(parts.config)
        self._logits = LogitsBuffer()
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

    def thread_counts(self) -> list[int]:
        return [torch.get_num_threads()]

    def snapshot(self) -> SchedulerSnapshot:
        parts, config = self.parts, self.parts.config
        return scheduler_snapshot(
            parts.book, parts.clock.now(), config.max_num_seqs, config.max_num_batched_tokens
        )

    def step(self) -> list[RequestOutput]:
        """One scheduling step; outputs of requests that progressed or ended."""
        parts, life = self.parts, self.parts.life
        outputs = life.take_in()
        step = begin_single_step(parts.book, self.policy.plan(self.snapshot()))
        for request in step.preempted:
            request.state = RequestState.WAITING
        if not step.batch:
            return outputs
        works = []
        now = parts.clock.now()
        for request, num_tokens in step.batch:
            start = request.num_computed_tokens
            end = start + num_tokens
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            works.append(request_work(request, start, end))
        (logits, sampling), measured = parts.clock.run_single(
            step, self.units, partial(self._execute, works)
        )
        if parts.step_log:
            es = step.execution_state(self.units)[0]
            write_step(parts.step_log, step.record(parts.clock.now(), self.units, es, measured))
            parts.step_log.flush()
        end_single_step(parts.book, step)
        for (request, _), work in zip(step.batch, works, strict=True):
            if work.prompt_targets:
                request.keep_prompt_logprobs(work.start, work.prompt_logprobs)
            if request.num_computed_tokens < request.num_tokens:
                request.state = RequestState.PREFILLING
        # The runner's row order (prompts of one token sit with the decode rows).
        sampled = [step.batch[i][0] for i in sampling]
        if sampled:
            stop_sets = [r.stop_ids for r in sampled]
            tokens, logprobs = parts.sampler.sample(logits, sampled, stop_sets)
            now = parts.clock.now()
            for request, token, logprob in zip(sampled, tokens, logprobs, strict=True):
                life.append_token(request, token, logprob, now)
        for request in sampled:
            outputs.append(life.output(request))
        return outputs

    def _execute(self, works: list[SeqWork]) -> tuple[torch.Tensor, list[int]]:
        parts = self.parts
        logits, sampling = parts.runner.execute(works, self._logits)
        if parts.step_log and parts.device.type == "cuda":
            torch.cuda.synchronize(parts.device)  # the step's device time, not its launch time
        return logits, sampling

    # ---- the rest of the executor interface: one lane computes only inside `step()` ---------

    def wake(self) -> None:
        pass

    def has_pending(self) -> bool:
        return False

    def num_running(self) -> int:
        return len(self.parts.book.running)

    def lane_units(self) -> dict[str, tuple[int, float | None]]:
        return {}

    def step_times(self) -> dict[str, tuple[float, float]]:
        return {}  # the one-lane policies plan without a performance model

    def outputs_handed_off(self) -> None:
        pass

    def close(self) -> None:
        pass
