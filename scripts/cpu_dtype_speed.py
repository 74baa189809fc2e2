"""How fast this CPU computes in each dtype: the linear layers the model runs, then the default
model's prefill and a short generation, per dtype, alternated, medians of several rounds.
`--dtype auto` picks bf16 on a CPU only where it has native bf16 (AVX-512 bf16 or AMX); this is
the measurement behind that rule.

    .venv/bin/python scripts/cpu_dtype_speed.py --rounds 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from bulletserve import LLM, SamplingParams
from bulletserve.model.loader import cpu_has_native_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def linear_gflops(rows: int, dtype: torch.dtype, calls: int) -> float:
    """One MLP up-projection of the default model (576 -> 1536) on `rows` rows."""
    x = torch.randn(rows, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    F.linear(x, w)
    started = time.perf_counter()
    for _ in range(calls):
        F.linear(x, w)
    elapsed = (time.perf_counter() - started) / calls
    return 2 * rows * 576 * 1536 / elapsed / 1e9


def model_times(llm: LLM) -> tuple[float, float]:
    """(one 100-token prefill, 4 prompts of 100 tokens generating 16 tokens each), seconds."""
    prompts = [[(i * 37 + j * 11) % 5000 + 100 for j in range(100)] for i in range(4)]
    started = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    return prefill, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    names = args.dtypes.split(",")
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(
        f"capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {cpu_has_native_bf16()}"
    )
    print("| dtype | rows | GFLOP/s (median) |")
    print("| --- | ---: | ---: |")
    for rows in (1, 16, 256):
        for name in names:
            rates = [linear_gflops(rows, DTYPES[name], 5) for _ in range(args.rounds)]
            print(f"| {name} | {rows} | {statistics.median(rates):.1f} |")
    engines = {name: LLM(dtype=name, cpu_warmup_rows=0) for name in names}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            times[name].append(model_times(engines[name]))
    print("| dtype | 100-token prefill (ms) | 4 x (100 in, 16 out) (ms) |")
    print("| --- | ---: | ---: |")
    for name in names:
        prefill = statistics.median(t[0] for t in times[name]) * 1e3
        generate = statistics.median(t[1] for t in times[name]) * 1e3
        print(f"| {name} | {prefill:.0f} | {generate:.0f} |")


if __name__ == "__main__":
    main()
