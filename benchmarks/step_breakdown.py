"""Where a CPU step spends its time, op by op, against the floor of each part.

Runs the engine's model runner on the default model (or `--model`, `--load-format dummy`) for a
prefill step (`--prefill` prompts of `--prompt-len` tokens, one step) and decode steps (`--batch`
sequences at `--context` tokens each), and times every call of each part of the forward pass
(wall-clock: CPU ops are synchronous): the projections, the LM head, prefill and decode
attention with the KV write, norms, RoPE, SiLU * up, the embedding, and the rest (Python and
tensor glue), plus the runner's input preparation. Each part's floor is its FLOPs over the
GEMM peak measured here (a 512 x 576 x 3072 GEMM in the model's dtype, best of several), its
bytes over the measured bandwidth (a copy beyond the last-level cache where the weights outgrow
it, one within it where they fit), or, for prefill attention, its softmax's exponentials over
the rate of `torch.exp` measured here (one per causal score: with a head of 64 a score costs
256 FLOPs of GEMM and one exponential, and on two cores the exponentials can outweigh the
FLOPs), whichever is largest.

`--linear` runs the projections through a given GEMM instead of the one the loader's timing
picks (`auto`): oneDNN's packed one, our blocked fp32 one, or PyTorch's `F.linear`.

    .venv/bin/python benchmarks/step_breakdown.py --batch 1,16,64 --context 480 --prefill 4 \
        --prompt-len 512 [--dtype float32] [--linear auto] [--json out.json]

Cited in docs/benchmarks.md "Against vLLM on a CPU".
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from bulletserve import LLM
from bulletserve.engine.model_runner import SeqWork
from bulletserve.model import attention as attention_module
from bulletserve.model import decoder as decoder_module
from bulletserve.model import loader as loader_module
from bulletserve.model.cpu_kernels import FusedOps, blocked_linear_kernel, onednn_linear_kernel
from bulletserve.partition.measure import time_call


class Timers:
    """Accumulated wall seconds per part while `recording`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.recording = False
        self._depth = 0

    def wrap(self, part: str | Callable[..., str], function: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.recording or self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                name = part(*args, **kwargs) if callable(part) else part
                self.seconds[name] += time.perf_counter() - start
                self._depth -= 1

        return timed

    @contextmanager
    def record(self):
        self.seconds.clear()
        self.recording = True
        try:
            yield self.seconds
        finally:
            self.recording = False


def _projection_name(module: decoder_module.Linear, x: torch.Tensor) -> str:
    return f"linear {module.name}"


def instrument(llm: LLM, timers: Timers) -> None:
    """Wrap the model's parts (class methods, so every layer is covered) with timers."""
    model = llm.engine.model
    for name, module in model.named_modules():
        if isinstance(module, decoder_module.Linear):
            module.name = name.rsplit(".", 1)[-1]
    decoder_module.Linear.forward = timers.wrap(_projection_name, decoder_module.Linear.forward)
    attention_part = timers.wrap(
        lambda q, k, v, kc, vc, meta, scale: (
            "attention prefill + kv write" if meta.prefills else "attention decode + kv write"
        ),
        attention_module.paged_attention,
    )
    decoder_module.paged_attention = attention_part
    for method in ("rmsnorm", "add_rmsnorm"):
        setattr(FusedOps, method, timers.wrap("norm", getattr(FusedOps, method)))
    for cls in (decoder_module.RMSNorm,):
        cls.forward = timers.wrap("norm", cls.forward)
        cls.start = timers.wrap("norm", cls.start)
        cls.add_forward = timers.wrap("norm", cls.add_forward)
    decoder_module.StepRope.apply = timers.wrap("rope", decoder_module.StepRope.apply)
    FusedOps.silu_mul = timers.wrap("silu * up", FusedOps.silu_mul)
    decoder_module.DecoderLM.logits = timers.wrap("lm head", decoder_module.DecoderLM.logits)
    decoder_module.DecoderLM.embed = timers.wrap("embed", decoder_module.DecoderLM.embed)
    runner = llm.engine.runner
    runner.prepare = timers.wrap("prepare inputs", runner.prepare)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs; 0 where it cannot be read)."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s (read and write counted) of the best of a few copies of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_call(lambda: dst.copy_(src), lambda: None, 5)


def exp_rate() -> float:
    """Exponentials a second: `torch.exp` of 4 Mi fp32 values (a softmax's inner work), best of
    a few, on this thread's intra-op threads."""
    values = torch.randn(4 * 2**20)
    out = torch.empty_like(values)
    return values.numel() / time_call(lambda: torch.exp(values, out=out), lambda: None, 5)


def measure_peaks(dtype: torch.dtype, weight_bytes: int) -> tuple[float, float, str]:
    """(GEMM FLOP/s, memory bytes/s, where the weights stream from) on this thread's intra-op
    threads. The bandwidth is a copy's of a size that, as the weights, fits the last-level
    cache or does not: a 64 MiB copy stays in a 300 MiB L3 and runs at twice the speed of
    memory, which a model whose weights outgrow the cache never sees."""
    x = torch.randn(512, 576, dtype=dtype)
    w = torch.randn(3072, 576, dtype=dtype)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - start)
    flops = 2 * 512 * 576 * 3072 / best
    cache = last_level_cache_bytes()
    if weight_bytes <= cache // 2:
        return flops, copy_bandwidth(min(64 * 2**20, cache // 4)), "cache"
    return flops, copy_bandwidth(max(64 * 2**20, 2 * cache)), "memory"


def part_work(llm: LLM, rows: int, sampled: int, contexts: list[int], prefill: bool) -> dict:
    """FLOPs, bytes and exponentials of each part of one step with `rows` token rows."""
    c = llm.engine.model_config
    size = llm.engine.dtype.itemsize
    h, q, kv, inter, vocab = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size, c.vocab_size
    layers = c.num_layers
    shapes = {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h)}
    shapes["down_proj"] = (h, inter)
    work: dict[str, tuple[float, float, float]] = {}
    for name, (n, k) in shapes.items():
        flops = 2 * rows * n * k * layers
        data = (n * k + rows * (n + k)) * size * layers
        work[f"linear {name}"] = (flops, data, 0.0)
    work["lm head"] = (2 * sampled * vocab * h, (vocab * h + sampled * vocab * 2) * size, 0.0)
    if prefill:
        # causal: each prompt's queries attend half its keys on average
        scores = sum(n * (n + 1) / 2 * c.num_heads for n in contexts) * layers
        data = sum(n * (q + 4 * kv) for n in contexts) * size * layers
        work["attention prefill + kv write"] = (4 * scores * c.head_dim, data, scores)
    else:
        flops = sum(4 * n * c.head_dim * c.num_heads for n in contexts) * layers
        data = sum(n * 2 * kv for n in contexts) * size * layers
        work["attention decode + kv write"] = (flops, data, 0.0)
    return work


def run_step(llm: LLM, works: list[SeqWork], timers: Timers, repeats: int) -> dict[str, float]:
    """Median seconds per part (and 'step' for the whole execute) over `repeats` runs."""
    runner = llm.engine.runner
    runs: list[dict[str, float]] = []
    for index in range(repeats + 1):  # the first run warms up
        with timers.record() as seconds:
            start = time.perf_counter()
            runner.execute(works)
            total = time.perf_counter() - start
        if index:
            runs.append({**seconds, "step": total})
    parts = {key for run in runs for key in run}
    return {key: statistics.median(run.get(key, 0.0) for run in runs) for key in parts}


def sequences(llm: LLM, count: int, length: int) -> list[list[int]]:
    """Block tables for `count` sequences of `length` tokens, taken from the engine's pool."""
    block = llm.engine.pool.block_size
    allocator = llm.engine.pool.allocator
    return [allocator.allocate(-(-(length + 1) // block)) for _ in range(count)]


def report(
    title: str, result: dict[str, float], work: dict, peaks: tuple[float, float, float]
) -> dict:
    step = result["step"]
    named = {k: v for k, v in result.items() if k != "step"}
    named["other (python, glue)"] = max(0.0, step - sum(named.values()))
    print(f"\n{title}: {step * 1e3:.2f} ms")
    print(f"  {'part':32s} {'ms':>8s} {'share':>6s} {'floor ms':>9s} {'x floor':>8s}")
    rows = {}
    floor_total = 0.0
    for part, seconds in sorted(named.items(), key=lambda item: -item[1]):
        floor = None
        if part in work:
            flops, data, exps = work[part]
            floor = max(flops / peaks[0], data / peaks[1], exps / peaks[2])
            floor_total += floor
        ratio = f"{seconds / floor:8.1f}" if floor else f"{'':8s}"
        floor_text = f"{floor * 1e3:9.2f}" if floor is not None else f"{'':9s}"
        print(f"  {part:32s} {seconds * 1e3:8.2f} {seconds / step:6.1%} {floor_text} {ratio}")
        rows[part] = {"ms": seconds * 1e3, "floor_ms": None if floor is None else floor * 1e3}
    print(f"  {'floor of the step':32s} {floor_total * 1e3:8.2f}   ({step / floor_total:.1f}x)")
    return {"step_ms": step * 1e3, "floor_ms": floor_total * 1e3, "parts": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=480, help="decode context per sequence")
    parser.add_argument("--prefill", type=int, default=4, help="prompts in the prefill step")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the breakdown here")
    parser.add_argument(
        "--linear", choices=["auto", "onednn", "blocked", "pytorch"], default="auto"
    )
    args = parser.parse_args()

    if args.linear != "auto":
        forced = {"onednn": onednn_linear_kernel, "blocked": blocked_linear_kernel}.get(args.linear)
        loader_module.packed_linear_kernel = lambda dtype, device, _weights: (
            forced(dtype, device) if forced else None
        )
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=2048)
    timers = Timers()
    instrument(llm, timers)
    weight_bytes = llm.engine.model_config.num_parameters() * llm.engine.dtype.itemsize
    gemm, bandwidth, source = measure_peaks(llm.engine.dtype, weight_bytes)
    peaks = (gemm, bandwidth, exp_rate())
    linear = llm.engine.model.packed_linear
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{llm.engine.dtype}: GEMM peak {peaks[0] / 1e9:.0f} GFLOP/s, "
        f"copy {peaks[1] / 1e9:.1f} GB/s ({weight_bytes / 2**30:.2f} GiB of weights, streamed "
        f"from {source}), exp {peaks[2] / 1e9:.2f} G/s; projections through "
        f"{'F.linear' if linear is None else type(linear).__name__}"
    )
    vocab = llm.engine.model_config.vocab_size
    results = {"dtype": str(llm.engine.dtype), "peaks": peaks, "from": source, "steps": {}}

    tables = sequences(llm, args.prefill, args.prompt_len)
    works = [
        SeqWork([(7 * i + j) % (vocab - 1) + 1 for j in range(args.prompt_len)], 0, t, True)
        for i, t in enumerate(tables)
    ]
    rows = args.prefill * args.prompt_len
    result = run_step(llm, works, timers, args.repeats)
    work = part_work(llm, rows, args.prefill, [args.prompt_len] * args.prefill, prefill=True)
    title = f"prefill step, {args.prefill} x {args.prompt_len} tokens"
    results["steps"][title] = report(title, result, work, peaks)
    for table in tables:
        llm.engine.pool.allocator.free(table)

    for batch in [int(b) for b in args.batch.split(",")]:
        tables = sequences(llm, batch, args.context)
        works = [
            SeqWork([(i % (vocab - 1)) + 1], args.context, t, True) for i, t in enumerate(tables)
        ]
        result = run_step(llm, works, timers, args.repeats)
        work = part_work(llm, batch, batch, [args.context + 1] * batch, prefill=False)
        title = f"decode step, batch {batch} at context {args.context}"
        results["steps"][title] = report(title, result, work, peaks)
        for table in tables:
            llm.engine.pool.allocator.free(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
