"""What our C kernels buy: one engine, step latencies with the kernels switched in and out.

Four settings, alternated in one process so that the machine's drift hits them alike:
`pytorch` (PyTorch ops only), `attention` (our decode-attention kernel, the rest PyTorch), `all`
(decode attention plus the fused residual-add + RMSNorm, RoPE and SiLU * up) and `packed` (all
of those plus the packed fp32 linear kernel for every projection, on a second copy of the model
loaded with its weights packed; fp32 only).
Steps: decodes of 64, 8 and 1 sequences at context 320 (their blocks interleaved in the pool, as
a running batch leaves them) and a prefill of 8 prompts of 256 tokens. Medians over the repeats,
on `--threads` intra-op threads (a lane's share).

    .venv/bin/python benchmarks/bench_cpu_kernels.py --repeats 7 --dtype float32 --threads 1

Cited in docs/benchmarks.md "Offline throughput".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import LLMEngine
from bulletserve.engine.model_runner import SeqWork
from bulletserve.model.cpu_kernels import packed_linear_kernel
from bulletserve.model.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()

    config = EngineConfig(dtype=args.dtype, max_model_len=1024)
    engine = LLMEngine(config)
    torch.set_num_threads(args.threads)
    unpacked = load_model(engine.source, engine.dtype, engine.device, 1024, pack_linear=False)
    packed = None
    linear = packed_linear_kernel(engine.dtype, engine.device)
    if linear is not None:
        packed = load_model(engine.source, engine.dtype, engine.device, 1024, pack_linear=False)
        packed.use_packed_linear(linear)
    ops, kernel = unpacked.norm.ops, engine.runner.decode_kernel
    if ops is None or kernel is None:
        raise SystemExit("our CPU kernels could not be built here (see the warning above)")
    settings = ("pytorch", "attention", "all") + (("packed",) if packed is not None else ())

    def use(setting: str) -> None:
        engine.runner.model = packed if setting == "packed" else unpacked
        unpacked.use_fused_ops(ops if setting == "all" else None)
        engine.runner.decode_kernel = kernel if setting != "pytorch" else None

    allocate = engine.pool.allocator.allocate
    batch, context, block = 64, 320, engine.pool.block_size
    tables: list[list[int]] = [[] for _ in range(batch)]
    for _ in range(-(-(context + 1) // block)):  # one block per sequence in turn
        for table in tables:
            table.extend(allocate(1))
    steps = {
        f"decode {rows} x ctx 320": [
            SeqWork([100 + i], context, t, True) for i, t in enumerate(tables[:rows])
        ]
        for rows in (64, 8, 1)
    }
    steps |= {
        "prefill 8 x 256": [
            SeqWork(list(range(1000 + i, 1256 + i)), 0, allocate(256 // block), True)
            for i in range(8)
        ],
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for setting in settings:
            use(setting)
            for name, works in steps.items():
                engine.runner.execute(works)  # warm
                start = time.perf_counter()
                engine.runner.execute(works)
                times.setdefault((name, setting), []).append(time.perf_counter() - start)
    result = {}
    for name in steps:
        base = statistics.median(times[(name, "pytorch")])
        row = {s: statistics.median(times[(name, s)]) * 1e3 for s in settings}
        row["speedup_all"] = base * 1e3 / row["all"]
        cells = ", ".join(f"{s} {row[s]:.1f} ms" for s in settings)
        if "packed" in row:
            row["packed_vs_all"] = row["all"] / row["packed"]
            cells += f"; all / packed = {row['packed_vs_all']:.2f}x"
        result[name] = row
        print(f"{name}: {cells}; pytorch / all = {row['speedup_all']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
