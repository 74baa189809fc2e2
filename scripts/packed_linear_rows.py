"""Our packed fp32 linear kernel against PyTorch's GEMM, by row count and thread count.

One pass over every projection of the default model's step (30 layers x qkv, o, gate/up, down,
then the LM head; 540 MB in fp32, so the weights stream from memory as in a served step),
through `F.linear` and through the kernel on the same weights packed, alternated; medians of the
rounds after a warm-up one, and what they compute (GFLOP/s).

    .venv/bin/python scripts/packed_linear_rows.py --rows 1,8,16,24,32,64,256 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bulletserve.model.cpu_kernels import packed_linear_kernel
from bulletserve.model.presets import get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,24,32,64,256")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    kernel = packed_linear_kernel(torch.float32, torch.device("cpu"))
    if kernel is None:
        raise SystemExit("the kernel could not be built here (see the warning above)")
    c = get_preset("smollm2-135m")
    layer = [
        (c.q_size + 2 * c.kv_size, c.hidden_size),
        (c.hidden_size, c.q_size),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    shapes = layer * c.num_layers + [(c.vocab_size, c.hidden_size)]
    weights = [torch.randn(shape) for shape in shapes]
    packed = [(kernel.pack(weight), weight.shape[0]) for weight in weights]
    flops_per_row = 2 * sum(out * width for out, width in shapes)

    def ours(inputs: list[torch.Tensor]) -> None:
        for x, (weight, out) in zip(inputs, packed, strict=True):
            kernel(x, weight, out)

    def pytorch(inputs: list[torch.Tensor]) -> None:
        for x, weight in zip(inputs, weights, strict=True):
            F.linear(x, weight)

    print("threads rows  pytorch ms  ours ms  pytorch / ours  pytorch GFLOP/s  ours GFLOP/s")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = [torch.randn(rows, weight.shape[1]) for weight in weights]
            times: dict[str, list[float]] = {"pytorch": [], "ours": []}
            for _ in range(args.rounds + 1):
                for name, path in (("pytorch", pytorch), ("ours", ours)):
                    start = time.perf_counter()
                    path(inputs)
                    times[name].append(time.perf_counter() - start)
            base, mine = (statistics.median(times[k][1:]) * 1e3 for k in ("pytorch", "ours"))
            rate = flops_per_row * rows / 1e6
            print(
                f"{threads:7d} {rows:4d} {base:11.1f} {mine:8.1f} {base / mine:15.2f} "
                f"{rate / base:16.0f} {rate / mine:13.0f}"
            )


if __name__ == "__main__":
    main()
