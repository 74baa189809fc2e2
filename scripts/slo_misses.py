"""Which SLO each request of a sweep missed: per configuration and rate, the requests over
their TTFT SLO, over the TPOT SLO, over both, and failed (the SLOs of each run's summary, the
checks of `bullet bench`'s attainment).

    .venv/bin/python scripts/slo_misses.py docs/data/bench-cpu-26 [--labels bullet,...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bulletserve.bench.metrics import SLO, tpot_s
from bulletserve.bench.records import load_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--labels", default="bullet,prefill-first,chunked-512")
    args = parser.parse_args()
    print("| config | rate | requests | TTFT missed | TPOT missed | both | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label in args.labels.split(","):
        path = args.sweep / f"{label}.json"
        if not path.exists():
            continue
        for run in load_result(path).runs:
            raw = run.summary["slo"]
            slo = SLO(raw["ttft_per_token_ms"], raw["tpot_ms"], raw.get("ttft_base_ms", 0.0))
            done = [r for r in run.requests if r.success]
            ttft = {r.index for r in done if r.ttft_s * 1e3 > slo.ttft_limit_ms(r.input_len)}
            tpot = {r.index for r in done if (tpot_s(r) or 0.0) * 1e3 > slo.tpot_ms}
            print(
                f"| {label} | {run.request_rate:g} | {len(run.requests)} | {len(ttft)} | "
                f"{len(tpot)} | {len(ttft & tpot)} | {len(run.requests) - len(done)} |"
            )


if __name__ == "__main__":
    main()
