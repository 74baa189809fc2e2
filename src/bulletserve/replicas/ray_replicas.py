"""N engines as Ray actors behind one `EngineClient`, which the API server drives as it drives
one engine: `bullet serve --data-parallel-size N --distributed-executor-backend ray`.

Each replica is an actor holding an `AsyncEngine` on its own devices (`num_gpus` = its
tensor-parallel size on GPUs, its share of the cores on a CPU); a request's outputs stream back
through a Ray streaming generator. The router (`router.Router`) sends each request to the
replica with the fewest waiting prompt tokens, or to the one that served its prompt's prefix.
`ray.init()` joins the cluster that `RAY_ADDRESS` (or `--ray-address`) names, else starts one
on this machine; the same code serves on both. A replica that dies is left out of routing (its
open requests fail with the cause); the others keep serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from bulletserve.engine.async_engine import EngineDeadError, StreamEndedError
from bulletserve.engine.client import EngineStats, ModelFront
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.partition import usable_cores
from bulletserve.replicas.router import NoReplicaError, ReplicaLoad, Router, prefix_key
from bulletserve.sched.slo import ServiceClass

logger = logging.getLogger(__name__)

# How often the replicas' statistics (for /metrics) are read, and how long a read may take.
STATS_INTERVAL_S = 1.0
STATS_TIMEOUT_S = 5.0
# How long the replicas may take to load their models.
START_TIMEOUT_S = 600.0


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "data-parallel replicas run on Ray, which is not installed: "
            "`pip install bulletserve[ray]`"
        ) from None
    return ray


def _check_resources(cluster: dict[str, float], replica: dict[str, float], size: int) -> None:
    """Fail now, naming the shortfall, where the cluster cannot hold every replica (Ray would
    wait for resources that never come)."""
    for name, resource in (("num_gpus", "GPU"), ("num_cpus", "CPU")):
        needed = replica.get(name, 0) * size
        if needed > cluster.get(resource, 0):
            raise ValueError(
                f"{size} replicas of {replica[name]:g} {resource}s each need {needed:g} "
                f"{resource}s; the Ray cluster has {cluster.get(resource, 0):g} (lower "
                "--data-parallel-size, --tensor-parallel-size or --num-threads)"
            )


class ReplicaActor:
    """One replica (a Ray actor): an AsyncEngine in the actor's process."""

    def __init__(self, config: EngineConfig) -> None:
        from bulletserve.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(config)

    def ready(self) -> bool:
        return True

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        service: ServiceClass,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        outputs = self.engine.generate(prompt_ids, params, request_id, None, service, lora)
        async for output in outputs:
            yield output

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self.engine.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self.engine.unload_lora_adapter(name)

    def stats(self) -> EngineStats:
        if not self.engine.healthy:
            raise EngineDeadError(f"the engine has failed: {self.engine.error!r}")
        return self.engine.stats()

    def describe(self) -> list[str]:
        return self.engine.describe()

    def shutdown(self) -> None:
        self.engine.shutdown()


@dataclasses.dataclass
class _Replica:
    actor: Any
    waiting_tokens: int = 0
    open_streams: int = 0
    error: BaseException | None = None
    stats: EngineStats = dataclasses.field(default_factory=EngineStats)


class RayReplicas:
    """`size` replicas of the engine `config` describes, behind one `EngineClient`."""

    def __init__(
        self,
        config: EngineConfig,
        size: int,
        address: str | None = None,
        router: Router | None = None,
    ) -> None:
        ray = _ray()
        self._ray = ray
        self.front = ModelFront.load(config)
        self.router = router or Router(affinity=config.enable_prefix_caching)
        self._replicas: list[_Replica] = []
        self._lock = threading.Lock()
        self._streams: dict[str, Any] = {}  # request id -> its streaming generator
        self._ended: dict[str, str] = {}  # request id -> why the server ended its stream
        self._stop = threading.Event()
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, log_to_driver=False)
        try:
            self._start(config, size)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d replicas on Ray", size)
        self._poller = threading.Thread(target=self._poll, name="replica-stats", daemon=True)
        self._poller.start()

    def _start(self, config: EngineConfig, size: int) -> None:
        """Create the replicas' actors, each with its devices, and wait until they serve."""
        ray = self._ray
        on_gpu = config.device == "cuda" or (
            config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        if on_gpu:
            resources = {"num_gpus": config.tensor_parallel_size, "num_cpus": 1}
        else:
            ranks = config.tensor_parallel_size
            threads = config.num_threads or max(1, usable_cores() // (size * ranks))
            config = dataclasses.replace(config, device="cpu", num_threads=threads)
            resources = {"num_cpus": threads * ranks}
        _check_resources(ray.cluster_resources(), resources, size)
        actor_class = ray.remote(ReplicaActor)
        self._replicas = [
            _Replica(actor_class.options(max_restarts=0, **resources).remote(config))
            for _ in range(size)
        ]
        ray.get([r.actor.ready.remote() for r in self._replicas], timeout=START_TIMEOUT_S)

    # ---- EngineClient ---------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return any(r.error is None for r in self._replicas)

    @property
    def error(self) -> BaseException | None:
        if self.healthy:
            return None
        return NoReplicaError(
            "every replica has died: " + "; ".join(repr(r.error) for r in self._replicas)
        )

    @property
    def num_running(self) -> int:
        return sum(r.stats.num_running for r in self._replicas if r.error is None)

    def stats(self) -> EngineStats:
        total = EngineStats()
        for replica in self._replicas:
            if replica.error is None:
                total = total + replica.stats
        return total

    def describe(self) -> list[str]:
        """The first replica's lines (every replica runs the same config), and their count."""
        first = self._replicas[0].actor.describe.remote()
        lines = self._ray.get(first, timeout=STATS_TIMEOUT_S)
        return [f"replicas: {len(self._replicas)} (Ray)", *lines]

    def loads(self) -> list[ReplicaLoad]:
        with self._lock:
            return self._loads()

    def _loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(r.error is None, r.waiting_tokens, r.open_streams) for r in self._replicas
        ]

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        service: ServiceClass = ServiceClass(),
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the replica the router chose (`lora`: its LoRA adapter,
        which every replica holds). A replica that dies before
        the request's first output hands it to another (nothing has reached the client yet)."""
        prompt_ids = self.front.tokenize(prompt)
        self.front.check_prompt(prompt_ids)
        for _ in self._replicas:
            index, replica, stream = self._send(prompt_ids, params, request_id, service, lora)
            waiting, finished = True, False
            try:
                async for ref in stream:
                    output = await ref
                    if waiting:
                        waiting = False
                        with self._lock:
                            replica.waiting_tokens -= len(prompt_ids)
                    finished = output.finished
                    yield output
                return
            except Exception as exc:
                error = self._failure(index, request_id, exc)
                if not (waiting and self._died(exc)):
                    raise error from None
                logger.warning("request %s: replica %d died; sending it on", request_id, index)
            finally:
                with self._lock:
                    self._streams.pop(request_id, None)
                    self._ended.pop(request_id, None)
                    replica.open_streams -= 1
                    if waiting:
                        replica.waiting_tokens -= len(prompt_ids)
                if not finished:
                    self._ray.cancel(stream)
        raise EngineDeadError("every replica has died")

    def _send(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        service: ServiceClass,
        lora: str | None = None,
    ) -> tuple[int, _Replica, Any]:
        """Route the request and start it there: (replica index, replica, its output stream).
        A prefix is another under each adapter (its KV is the adapter's)."""
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            try:
                key = prefix_key(prompt_ids)
                if key is not None and lora is not None:
                    key = hash((key, lora))
                index = self.router.choose(self._loads(), key)
            except NoReplicaError as exc:
                raise EngineDeadError(str(exc)) from None
            replica = self._replicas[index]
            replica.waiting_tokens += len(prompt_ids)
            replica.open_streams += 1
            stream = replica.actor.generate.options(num_returns="streaming").remote(
                prompt_ids, params, request_id, service, lora
            )
            self._streams[request_id] = stream
        return index, replica, stream

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """On every replica (each serves every adapter)."""
        await asyncio.gather(
            *(r.actor.load_lora_adapter.remote(name, path) for r in self._replicas)
        )

    async def unload_lora_adapter(self, name: str) -> None:
        await asyncio.gather(*(r.actor.unload_lora_adapter.remote(name) for r in self._replicas))

    def end_streams(self, message: str) -> None:
        """End every open stream (the server's shutdown): each raises StreamEndedError."""
        with self._lock:
            streams = dict(self._streams)
            self._ended.update({request_id: message for request_id in streams})
        for stream in streams.values():
            self._ray.cancel(stream)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.front.close()
        ray = self._ray
        alive = [r.actor for r in self._replicas if r.error is None]
        try:
            ray.get([actor.shutdown.remote() for actor in alive], timeout=timeout)
        except Exception as exc:  # a replica that cannot stop cleanly is killed below
            logger.warning("replicas did not shut down cleanly: %r", exc)
        for replica in self._replicas:
            ray.kill(replica.actor)
        if self._started_ray:
            ray.shutdown()

    def kill_replica(self, index: int) -> None:
        """Kill one replica's actor (what a lost node does), as tests and drills need."""
        self._ray.kill(self._replicas[index].actor)

    # ---- internals ------------------------------------------------------------------------

    def _failure(self, index: int, request_id: str, exc: Exception) -> Exception:
        """What a request's failure on replica `index` means for the server."""
        ray = self._ray
        ended = self._ended.pop(request_id, None)
        if ended is not None:
            return StreamEndedError(ended)
        cause = exc
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause if exc.cause is not None else exc
        if isinstance(cause, (ValueError, StreamEndedError)):
            return cause
        if self._died(exc):
            self._mark_dead(index, exc)
            return EngineDeadError(f"replica {index} died: {exc}")
        return EngineDeadError(f"replica {index} failed: {cause!r}")

    def _died(self, exc: BaseException) -> bool:
        return isinstance(exc, self._ray.exceptions.RayActorError)

    def _mark_dead(self, index: int, exc: BaseException) -> None:
        with self._lock:
            if self._replicas[index].error is None:
                logger.error("replica %d is out of service: %r", index, exc)
                self._replicas[index].error = exc

    def _poll(self) -> None:
        ray = self._ray
        while not self._stop.wait(STATS_INTERVAL_S):
            for index, replica in enumerate(self._replicas):
                if replica.error is not None:
                    continue
                try:
                    replica.stats = ray.get(replica.actor.stats.remote(), timeout=STATS_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:
                    continue  # busy; its last statistics stand
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    self._mark_dead(index, exc)
