"""How OpenMP's way of waiting serves on cores another process also uses.

A burst of requests through the engine, each OpenMP setting in a fresh process (libgomp reads
its environment once), alone and beside one busy process of the same priority, interleaved
over rounds; the medians of each. `import bulletserve` sets a wait policy only where the user
has none, so each setting here is exactly what it names.

    .venv/bin/python benchmarks/bench_shared_cores.py --rounds 3 \\
        --setting "OMP_WAIT_POLICY=active GOMP_SPINCOUNT=300000" \\
        --setting "OMP_WAIT_POLICY=active GOMP_SPINCOUNT=1000" --policy chunked

Cited in docs/benchmarks.md "Threads on shared cores".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

BURST = """
import random, time
from bulletserve import LLM, SamplingParams
llm = LLM(max_model_len=512, policy={policy!r})
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(40, 200))] for _ in range({n})]
params = SamplingParams(max_tokens={tokens}, temperature=0, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=2))
start = time.perf_counter()
llm.generate(prompts, params)
print(time.perf_counter() - start)
"""

# One core kept busy by a process of the same priority.
BUSY = "while True: pass"


def burst_seconds(setting: str, script: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(pair.split("=", 1) for pair in setting.split())
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"the burst under {setting!r} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", action="append", required=True, help="VAR=VALUE ...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="chunked")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    script = BURST.format(policy=args.policy, n=args.requests, tokens=args.output_tokens)
    seconds: dict[tuple[str, str], list[float]] = {}
    for round_ in range(1, args.rounds + 1):
        for setting in args.setting:
            alone = burst_seconds(setting, script)
            busy = subprocess.Popen([sys.executable, "-c", BUSY])
            try:
                beside = burst_seconds(setting, script)
            finally:
                busy.kill()
                busy.wait()
            seconds.setdefault((setting, "alone"), []).append(alone)
            seconds.setdefault((setting, "beside"), []).append(beside)
            print(f"round {round_} | {setting} | alone {alone:.3f} s | beside {beside:.3f} s")
    print(
        f"\nmedians of {args.rounds} rounds ({args.policy}, {args.requests} x {args.output_tokens})"
    )
    for setting in args.setting:
        alone = statistics.median(seconds[(setting, "alone")])
        beside = statistics.median(seconds[(setting, "beside")])
        print(
            f"{setting}: alone {alone:.3f} s, beside a busy process {beside:.3f} s "
            f"({alone / beside:.2f} of its own alone throughput)"
        )


if __name__ == "__main__":
    main()
