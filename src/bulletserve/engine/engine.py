"""The engine: requests in (tokenized and checked), outputs out (the requests' life,
`engine.life`); its executor carries the policy's plans out on the device
(`engine.single_lane`: snapshot -> plan -> model step -> sampling; `engine.lanes`: Bullet's
two lanes).

`add_request` and `abort_request` may be called from any thread; `step` runs on the engine's
own thread (the lanes on theirs) and only there does request state change.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from bulletserve.bookkeeping.book import RequestBook
from bulletserve.bookkeeping.clock import Clock, RealClock
from bulletserve.dist.parallel import TensorParallel
from bulletserve.engine.client import DecodingState, EngineStats, ModelFront
from bulletserve.engine.config import EngineConfig, lora_module
from bulletserve.engine.cuda_graphs import DecodeGraphs
from bulletserve.engine.draft_model import DraftModel
from bulletserve.engine.lanes import Lanes
from bulletserve.engine.life import RequestLife
from bulletserve.engine.lora import LoadedAdapter, LoRARegistry, LoRARequest, UnknownAdapterError
from bulletserve.engine.model_runner import WarmGemms, builds_gemm_kernels, warm_cpu_gemms
from bulletserve.engine.parts import EngineParts
from bulletserve.engine.ranks import Ranks, build_device_side, rank_device, rank_threads
from bulletserve.engine.request import (
    Request,
    RequestOutput,
    RequestTimings,
)
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.single_lane import SingleLane
from bulletserve.model.decoder import DecoderLM
from bulletserve.model.file_error import ModelFileError
from bulletserve.model.loader import DTYPES, resolve_dtype
from bulletserve.model.source import resolve_model
from bulletserve.partition import TeamThread
from bulletserve.sched.base import Policy, check_priority
from bulletserve.sched.slo import ServiceClass
from bulletserve.spec.counters import SpecCounters

if TYPE_CHECKING:
    from bulletserve.sched.bullet import BulletPolicy

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available")
    return torch.device(name)


class LLMEngine:
    """The engine: the model, the KV pool and the tokenizer, the requests' life
    (`engine.life`: intake, detokenization, stops, outputs) and the executor that carries each
    policy's plans out and hands what its steps sampled to that life: one lane
    (`engine.single_lane`) for chunked and prefill-first, Bullet's two (`engine.lanes`). The
    executor gets the parts it works with (`engine.parts`), never the engine."""

    def __init__(
        self,
        config: EngineConfig,
        model: DecoderLM | None = None,
        clock: Clock | None = None,
        team: TeamThread | None = None,
    ) -> None:
        """`model`: weights already loaded from `config.model` (as `bullet profile` has them),
        used instead of loading them again. `clock`: the wall clock unless a test gives a
        virtual one. `team`: on a CPU under bullet, the thread this engine is built on, which
        runs every multi-threaded lane step (`partition.TeamThread`)."""
        self.config = config
        self.clock: Clock = clock or RealClock()
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(rank_threads(config))
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.dtype == "auto" and self.device.type == "cpu" and self.dtype == torch.float32:
            logger.info(
                "--dtype auto: float32, as this CPU has no native bf16 (AVX-512 bf16 or AMX)"
            )
        self.source = resolve_model(config.model, config.load_format, config.revision)
        self.front = ModelFront.load(config, self.source)
        self.tokenizer = self.front.tokenizer
        self.max_model_len = self.front.max_model_len
        # Under --tensor-parallel-size N, the other ranks' processes (closed with the engine).
        self.ranks: Ranks | None = None
        tp = TensorParallel()
        if config.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("a loaded model cannot be sharded over tensor-parallel ranks")
            self.ranks = Ranks.start(config, self.device)
            tp = self.ranks.tp
        try:
            self._set_up(config, tp, model, team)
        except BaseException:
            self._close_ranks()
            raise

    def _set_up(
        self,
        config: EngineConfig,
        tp: TensorParallel,
        model: DecoderLM | None,
        team: TeamThread | None,
    ) -> None:
        """The device side (this rank's), the request book and the executor."""
        side = build_device_side(
            config,
            self.source,
            rank_device(self.device, 0),
            self.dtype,
            self.max_model_len,
            tp,
            model,
        )
        self.model, self.pool, self.runner = side.model, side.pool, side.runner
        self.model_config = self.model.config
        if self.pool.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV pool holds {self.pool.num_blocks * config.block_size} tokens, fewer than "
                f"--max-model-len {self.max_model_len}: raise --kv-cache-memory or lower "
                "--max-model-len"
            )
        self._check_first_forward()
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.graphs = self._decode_graphs()
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = self.front.eos_token_ids
        self.book: RequestBook[Request] = RequestBook(self.pool.allocator, self.pool.block_size)
        delay_ms = config.max_queue_delay_ms
        self.life = RequestLife(
            self.tokenizer,
            self.max_model_len,
            self.book,
            self.clock,
            None if delay_ms is None else delay_ms / 1e3,
        )
        self._ids = itertools.count()
        # LoRA adapters (--enable-lora): those named at start loaded now.
        self.lora: LoRARegistry | None = None
        if config.enable_lora:
            lora_dtype = self.dtype
            if config.lora_dtype != "auto":
                try:
                    lora_dtype = DTYPES[config.lora_dtype]
                except KeyError:
                    raise ValueError(
                        f"--lora-dtype must be auto or one of {', '.join(DTYPES)}, not "
                        f"{config.lora_dtype!r}"
                    ) from None
            self.lora = LoRARegistry(
                self.model_config,
                config.max_lora_rank,
                lora_dtype,
                self.device,
                config.max_cpu_loras,
            )
            for module in config.lora_modules:
                self.lora.load(*lora_module(module))
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            # The target's pool's blocks, and room for every request's drafts past them.
            room = -(-spec.num_speculative_tokens // config.block_size)
            draft = DraftModel.load(
                spec,
                self.tokenizer,
                self.model_config.vocab_size,
                self.device,
                self.dtype,
                self.max_model_len,
                self.pool.num_blocks + config.max_num_seqs * room,
                config.block_size,
                config.seed,
            )
        # --step-log: one JSON line per step (the executor writes it).
        self.step_log = open(config.step_log, "a") if config.step_log else None
        parts = EngineParts(
            config,
            self.clock,
            self.book,
            self.life,
            self.model,
            self.runner,
            self.sampler,
            self.device,
            self.dtype,
            self.step_log,
            draft,
        )
        self.executor: Executor = _make_executor(parts, team)
        self.policy = self.executor.policy
        if builds_gemm_kernels(self.model, self.device) and config.cpu_warmup_rows:
            self._warm_cpu_gemms()

    def _check_first_forward(self) -> None:
        """A short prompt through the loaded weights before anything is served: a file whose
        weights compute NaN fails at load, naming the first layer that did (ModelFileError)."""
        length = min(self.pool.block_size, self.max_model_len)
        vocab = self.model_config.vocab_size
        ids = [t for t in self.front.tokenize("The capital of France is") if t < vocab]
        blocks = self.pool.allocator.allocate(1)
        try:
            self.runner.check_finite((ids or list(range(vocab)))[:length], blocks)
        except ModelFileError as exc:
            raise exc.in_file(self.source.path or self.source.name) from None
        finally:
            self.pool.allocator.free(blocks)

    def _decode_graphs(self) -> DecodeGraphs | None:
        if self.ranks is not None:
            logger.warning(
                "decode steps run eagerly: CUDA graphs are not captured under tensor parallelism"
            )
            return None
        if self.runner.decode_kernel is None:
            logger.warning(
                "decode steps run eagerly: CUDA graphs need our Triton decode kernel (Triton is "
                "missing or BULLET_TRITON=0)"
            )
            return None
        return DecodeGraphs(
            self.model,
            self.pool,
            self.device,
            self.runner.decode_kernel,
            self.config.max_num_seqs,
            self.max_model_len,
        )

    def _warm_cpu_gemms(self) -> None:
        config = self.config
        started = time.perf_counter()
        counts = self.executor.thread_counts()
        rows = min(config.cpu_warmup_rows, config.max_num_batched_tokens)
        self.runner.tp.announce("decode", WarmGemms(rows, config.max_num_seqs, counts))
        built = warm_cpu_gemms(self.model, rows, config.max_num_seqs, counts)
        logger.info(
            "built %d GEMM kernels (steps up to %d rows, on %s threads) in %.1f s",
            built,
            rows,
            "/".join(map(str, counts)),
            time.perf_counter() - started,
        )

    # ---- called from any thread -------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.front.tokenize(prompt)

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError naming the problem if these prompt tokens cannot be served."""
        self.front.check_prompt(token_ids)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        service: ServiceClass = ServiceClass(),
        decoding: DecodingState | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> str:
        """Queue a request; raises ValueError for bad input before anything is queued.
        `service`: its priority and SLO (None: the server's, `--slo-*`); `decoding`: its
        `front.decoding_state(params)` where the caller built it already (off its loop);
        `lora_request`: its LoRA adapter, by name (one loaded) or as vLLM's `LoRARequest`
        (loaded from its path on first use)."""
        lora = self.lora_adapter(lora_request)
        check_priority(service.priority, self.config.scheduling_policy)
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: a request is one sequence; LLM.generate and the server run a "
                "prompt's n sequences as n requests (SamplingParams.for_choice)"
            )
        token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids)
        decoding = decoding or self.front.decoding_state(params)
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            params=params,
            timings=RequestTimings(arrival=arrival_time or self.clock.now()),
            stop_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else self.eos_token_ids),
            grammar=decoding.grammar,
            bad_words_ids=decoding.bad_words_ids,
            service=replace(service, slo=service.slo or self.config.slo),
            lora=lora,
        )
        if params.seed is not None:
            request.generator = self.sampler.new_request_generator(params.seed)
        self.life.add(request)
        self.executor.wake()
        return request.request_id

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` under `name` from now on (vLLM's runtime load);
        ValueError where LoRA is off, the name is taken or the adapter cannot be served."""
        if self.lora is None:
            raise ValueError("a LoRA adapter needs the engine started with --enable-lora")
        if name in self.lora.served:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded; unload it first")
        self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Serve the adapter `name` no more (requests running with it finish with it);
        `UnknownAdapterError` where none has the name."""
        if self.lora is None or name not in self.lora.served:
            raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded")
        self.lora.unload(name)

    def lora_adapter(self, lora_request: LoRARequest | str | None) -> LoadedAdapter | None:
        """The adapter a request names (None: the base model); ValueError where the engine
        serves none, or none of that name (`UnknownAdapterError`)."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("a LoRA adapter needs the engine started with --enable-lora")
        if isinstance(lora_request, LoRARequest):
            return self.lora.resolve(lora_request)
        adapter = self.lora.get(lora_request)
        if adapter is None:
            raise UnknownAdapterError(f"no LoRA adapter named {lora_request!r} is loaded")
        return adapter

    def abort_request(self, request_id: str) -> None:
        self.life.abort(request_id)
        self.executor.wake()

    @property
    def waiting(self) -> deque[Request]:
        return self.book.waiting

    @property
    def running(self) -> list[Request]:
        return self.book.running

    @property
    def num_preemptions(self) -> int:
        return self.book.num_preemptions

    @property
    def num_running(self) -> int:
        """Requests past admission and not finished."""
        return self.executor.num_running()

    def lane_units(self) -> dict[str, tuple[int, float | None]]:
        """lane -> (units it has now, last relative prediction error); one lane: none."""
        return self.executor.lane_units()

    def describe(self) -> list[str]:
        """What runs, one line a topic: the startup block `bullet serve` logs."""
        config, pool = self.config, self.pool
        if self.device.type == "cuda":
            where = f"{torch.cuda.get_device_name(self.device)} ({self.device})"
        else:
            where = f"CPU, {rank_threads(config)} threads"
        if config.tensor_parallel_size > 1:
            where += f", tensor parallel over {config.tensor_parallel_size} ranks"
        kv_gib = pool.kv.numel() * pool.kv.element_size() / 2**30
        policy = config.policy
        if policy == "chunked":
            policy += f" (chunks of up to {config.chunk_size} tokens)"
        elif policy == "bullet":
            slo = config.slo
            profile = config.hardware_profile or "measured at start (no --hardware-profile)"
            policy += (
                f" (partition {config.partition}; SLO TTFT {slo.ttft_per_token_ms:g} ms a prompt "
                f"token + {slo.ttft_base_ms:g} ms, TPOT {slo.tpot_ms:g} ms; profile {profile})"
            )
        if config.async_scheduling:
            policy += "; each step planned and launched while the last runs (--async-scheduling)"
            if self.device.type == "cpu":
                policy += ", which on a CPU overlaps nothing: it computes as it launches"
        return [
            f"model: {self.source.name} ({self.source.load_format})",
            f"dtype: {str(self.dtype).removeprefix('torch.')}; device: {where}",
            f"max model length: {self.max_model_len} tokens; at most {config.max_num_seqs} "
            f"sequences and {config.max_num_batched_tokens} tokens a step",
            f"KV cache: {pool.num_blocks * pool.block_size} tokens in {pool.num_blocks} blocks "
            f"of {pool.block_size} ({kv_gib:.2f} GiB); prefix caching "
            + ("on" if config.enable_prefix_caching else "off"),
            f"policy: {policy}",
            f"kernels: {self.runner.kernels()}",
            "speculative decoding: "
            + (
                "off" if config.speculative_config is None else config.speculative_config.describe()
            ),
            f"LoRA adapters: {self._describe_lora()}",
        ]

    def _describe_lora(self) -> str:
        if self.lora is None:
            return "off"
        held = ", ".join(
            f"{name} (rank {a.rank}, from {a.path}, loaded in {a.load_s:.2f} s)"
            for name, a in self.lora.served.items()
        )
        bound = self.config.max_cpu_loras
        memory = "" if bound is None else f", at most {bound} in memory"
        return f"on, rank up to {self.config.max_lora_rank}{memory}; " + (held or "none loaded yet")

    def stats(self) -> EngineStats:
        """The queues, the KV cache and the counters now (read without the engine's locks: a
        snapshot for metrics and routing, not for scheduling)."""
        allocator, book = self.pool.allocator, self.book
        waiting = list(book.waiting)
        return EngineStats(
            num_running=self.num_running,
            num_waiting=len(waiting),
            waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            kv_blocks_used=allocator.num_used,
            kv_blocks_total=allocator.num_blocks,
            num_preemptions=book.num_preemptions,
            prefix_cache_queries=book.prefix_queries,
            prefix_cache_hits=book.prefix_hits,
            prompt_tokens=self.life.prompt_tokens,
            generation_tokens=self.life.generation_tokens,
            lane_units=self.lane_units(),
            step_times=self.executor.step_times(),
            waiting_by_class=dict(Counter(r.service.name for r in waiting)),
            spec=self.executor.spec_counters(),
            running_loras=dict(Counter(r.lora.name for r in self.running if r.lora is not None)),
            waiting_loras=dict(Counter(r.lora.name for r in waiting if r.lora is not None)),
            max_loras=None
            if self.lora is None
            else (self.config.max_loras or len(self.lora.served)),
        )

    def close(self) -> None:
        """Stop the executor's background work, the other ranks, and close the step log."""
        self.executor.close()
        self.front.close()
        self._close_ranks()
        if self.step_log:
            self.step_log.close()

    def _close_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def has_unfinished(self) -> bool:
        """Work left, or outputs the executor produced that `step()` has not returned yet."""
        if self.executor.has_pending():
            return True
        return bool(self.life.pending_intake or self.waiting or self.running)

    # ---- engine thread ----------------------------------------------------------------------

    def outputs_handed_off(self) -> None:
        """The outputs of the last `step()` have been passed on (by the server: written out);
        the laned executor's lanes wait for this where `acks_handoff` is set."""
        self.executor.outputs_handed_off()

    def step(self) -> list[RequestOutput]:
        """Run the executor: one step of the single lane, or the outputs the lanes produced
        since the last call; outputs of requests that progressed or ended."""
        return self.executor.step()


class Executor(Protocol):
    """How an engine carries its policy's plans out: `engine.single_lane` or `engine.lanes`."""

    policy: Policy | BulletPolicy

    def thread_counts(self) -> list[int]:
        """The intra-op thread counts its steps run on (for the CPU GEMM warm-up)."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def wake(self) -> None:
        """A request or an abort came in."""

    def has_pending(self) -> bool:
        """Work or outputs of its own beyond the engine's queues."""
        ...

    def num_running(self) -> int: ...

    def lane_units(self) -> dict[str, tuple[int, float | None]]: ...

    def step_times(self) -> dict[str, tuple[float, float]]:
        """Step kind -> (predicted, measured) seconds of recent steps (none without a model)."""
        ...

    def spec_counters(self) -> SpecCounters | None:
        """Speculative decoding's counters since start (None: it does not speculate)."""
        ...

    def outputs_handed_off(self) -> None: ...

    def close(self) -> None: ...


def _make_executor(parts: EngineParts, team: TeamThread | None) -> Executor:
    if parts.config.policy == "bullet":
        return Lanes(parts, team)
    return SingleLane(parts)
