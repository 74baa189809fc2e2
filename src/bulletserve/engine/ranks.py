"""The device side of one rank (model shard, KV pool shard, runner), and under
`--tensor-parallel-size N` the N - 1 other ranks: rank 0 (the engine's process, which runs the
API server, the policy and the sampler) starts them as processes on this machine, one device
each (`cuda:R` on GPUs; on a CPU they share its cores, gloo between them), and each runs the
steps rank 0 announces (`ModelRunner`) on its shard, one thread per lane channel.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from bulletserve.bookkeeping.lane_core import Placement
from bulletserve.dist.parallel import CHANNELS, Channel, RankFailedError, TensorParallel
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.model_runner import (
    ModelRunner,
    PrefillPass,
    RunLayers,
    RunStep,
    StopRank,
    WarmGemms,
    warm_cpu_gemms,
)
from bulletserve.kv.pool import KVPool
from bulletserve.model.decoder import DecoderLM
from bulletserve.model.loader import load_config, load_model, resolve_dtype
from bulletserve.model.source import ModelSource, resolve_model
from bulletserve.partition import Units, lane_units, usable_cores

logger = logging.getLogger(__name__)

# How long a collective waits for a rank that neither answers nor closes its connection.
COLLECTIVE_TIMEOUT_S = 300.0
# How long a closing engine waits for each other rank's process to end.
RANK_EXIT_WAIT_S = 10.0
# How long a failed collective looks for the rank whose exit failed it (`failure_detail`).
RANK_EXIT_SEEN_S = 1.0


@dataclass
class DeviceSide:
    """What one rank holds on its device."""

    model: DecoderLM
    pool: KVPool
    runner: ModelRunner


def _settings(config: EngineConfig) -> dict[str, Any]:
    """`config` as the other ranks' command line carries it (JSON)."""
    settings = asdict(config)
    if config.speculative_config is not None:
        settings["speculative_config"] = config.speculative_config.to_dict()
    return settings


def build_device_side(
    config: EngineConfig,
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    tp: TensorParallel,
    model: DecoderLM | None = None,
) -> DeviceSide:
    """The model (this rank's shard, loaded unless given), a KV pool of the blocks every rank's
    memory holds (its KV heads), and the runner over them."""
    model = model or load_model(
        source,
        dtype,
        device,
        max_model_len,
        seed=config.seed,
        tp=tp,
        quantization=config.quantization,
    )
    blocks = KVPool.num_blocks_for(
        model.shard_config,
        config.block_size,
        dtype,
        device,
        config.kv_cache_memory,
        max_tokens_needed=config.max_num_seqs * max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    pool = KVPool(
        model.shard_config,
        tp.agree_min(blocks),
        config.block_size,
        dtype,
        device,
        config.enable_prefix_caching,
    )
    runner = ModelRunner(model, pool, device)
    # Every rank's steps must have the same rows (their all-reduces meet), and whether a CPU
    # pads them follows the GEMM each rank's loader timed fastest: pad if any rank does.
    runner.pad_rows = bool(tp.agree_max(int(runner.pad_rows)))
    return DeviceSide(model, pool, runner)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank R's device: `cuda:R` on GPUs, the CPU they share otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def rank_threads(config: EngineConfig) -> int:
    """A rank's CPU threads: `--num-threads`, or its share of the usable cores."""
    return config.num_threads or max(1, usable_cores() // config.tensor_parallel_size)


class Ranks:
    """Rank 0's handle on the other ranks: their processes and the group they joined."""

    def __init__(self, tp: TensorParallel, processes: dict[int, subprocess.Popen]) -> None:
        self.tp = tp
        self.processes = processes
        tp.failure_detail = self.failure_detail

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> Ranks:
        """Start ranks 1..N-1 and join them as rank 0."""
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"--tensor-parallel-size {size} needs {size} GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        backend = "nccl" if device.type == "cuda" else "gloo"
        # Processes of their own (not multiprocessing's spawn, which imports the caller's main
        # module again): `python -m bulletserve.engine.ranks`, the engine's settings as JSON.
        processes = {
            rank: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bulletserve.engine.ranks",
                    f"--rank={rank}",
                    f"--size={size}",
                    f"--init-method={init_method}",
                    f"--backend={backend}",
                    f"--device-type={device.type}",
                    f"--config={json.dumps(_settings(config))}",
                ]
            )
            for rank in range(1, size)
        }
        try:
            tp = _join_watching(processes, size, init_method, backend)
        except BaseException:
            _end(processes)
            raise
        logger.info("tensor parallelism: %d ranks (%s)", size, backend)
        return cls(tp, processes)

    def failure_detail(self) -> str:
        """Which ranks have exited, for an error message. A killed rank's sockets close a
        moment before its exit can be reaped: a failed collective waits up to
        RANK_EXIT_SEEN_S for that (a rank that hangs instead is named by no one)."""
        deadline = time.monotonic() + RANK_EXIT_SEEN_S
        while True:
            dead = [(r, p) for r, p in self.processes.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return ", ".join(f"rank {rank} exited with code {p.returncode}" for rank, p in dead)

    def close(self) -> None:
        """Stop every rank (after the lanes stopped announcing) and leave the group."""
        for channel in CHANNELS:
            try:
                self.tp.announce(channel, StopRank())
            except RankFailedError:
                break
        _end(self.processes)
        self.tp.close()


def _join_watching(
    processes: dict[int, subprocess.Popen], size: int, init_method: str, backend: str
) -> TensorParallel:
    """Join the group as rank 0, failing at once if another rank exits before it joined
    (joining would otherwise wait out the collective timeout)."""
    joined: list[TensorParallel] = []
    failed: list[BaseException] = []

    def join() -> None:
        try:
            joined.append(TensorParallel.join(0, size, init_method, backend, COLLECTIVE_TIMEOUT_S))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=join, name="rank-0-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        dead = {rank: p.returncode for rank, p in processes.items() if p.poll() is not None}
        if dead and thread.is_alive():
            raise RankFailedError(
                ", ".join(f"rank {r} exited with code {code}" for r, code in dead.items())
                + " before joining the group (its output above says why)"
            )
    if failed:
        raise failed[0]
    return joined[0]


def _end(processes: dict[int, subprocess.Popen]) -> None:
    for process in processes.values():
        try:
            process.wait(RANK_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(RANK_EXIT_WAIT_S)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _follow(
    rank: int, size: int, init_method: str, backend: str, config: EngineConfig, device_type: str
) -> None:
    """A rank other than 0: build the shard, then run each channel's announced steps."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(levelname)s %(message)s")
    device = rank_device(torch.device(device_type), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(rank_threads(config))
    tp = TensorParallel.join(rank, size, init_method, backend, COLLECTIVE_TIMEOUT_S)
    dtype = resolve_dtype(config.dtype, device)
    source = resolve_model(config.model, config.load_format, config.revision)
    max_model_len = config.max_model_len or load_config(source).max_position_embeddings
    side = build_device_side(config, source, device, dtype, max_model_len, tp)
    units = lane_units(device, rank_threads(config)) if config.policy == "bullet" else None
    failures: list[BaseException] = []
    threads = [
        threading.Thread(
            target=_guarded(failures, _serve_channel, tp, channel, side.runner, units),
            name=f"rank-{rank}-{channel}",
        )
        for channel in CHANNELS
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tp.close()
    if failures:
        raise SystemExit(f"rank {rank}: {failures[0]!r}")


def _guarded(failures: list[BaseException], fn: Callable[..., None], *args: object) -> Callable:
    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            failures.append(exc)

    return run


def _serve_channel(
    tp: TensorParallel, channel: Channel, runner: ModelRunner, units: Units | None
) -> None:
    """Run what rank 0 announces on `channel` until it says stop."""
    threads = torch.get_num_threads()
    device_pass: PrefillPass | None = None

    def placed(placement: Placement, work: Callable[[], object]) -> object:
        if placement.units is None or units is None:
            torch.set_num_threads(threads)
            return work()
        return units.run(placement.units, work, rest=placement.rest)

    while not isinstance(command := tp.receive(channel), StopRank):
        if isinstance(command, RunStep):
            placed(command.placement, partial(runner.execute, command.works, channel=channel))
        elif isinstance(command, RunLayers):
            if command.works is not None:
                device_pass = runner.begin_pass(command.works)
            assert device_pass is not None
            hidden, _ = placed(
                command.placement,
                partial(runner.run_layers, device_pass, command.first, command.last),
            )
            device_pass.hidden = hidden
        elif isinstance(command, WarmGemms):
            warm_cpu_gemms(
                runner.model, command.max_rows, command.max_sampled_rows, command.thread_counts
            )
        else:
            raise RuntimeError(f"unknown command {command!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device-type", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args()
    config = EngineConfig(**json.loads(args.config))
    _follow(args.rank, args.size, args.init_method, args.backend, config, args.device_type)


if __name__ == "__main__":
    main()
