"""The device check's measured GPU steps beside the performance model's predictions.

Reads the `steps` rows of `scripts/device_check.py`'s device_check.json (a prefill of
--prefill-len tokens and a decode of --decode-batch sequences at --context, alone and
co-running, at each split P/D) and predicts the same execution states from a hardware preset or
`bullet profile` JSON: how far the simulator's GPU presets are from this engine on that GPU.

    python benchmarks/gpu_steps_vs_model.py docs/data/h200-check/device_check.json --hardware h200

Cited in docs/benchmarks.md "GPU (one H200)" and docs/perf-model.md "First GPU check".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bulletserve.model.presets import get_preset
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.model import PerfModel
from bulletserve.sim.device_presets import load_hardware


def rows(
    steps: list[dict], perf: PerfModel, prefill_len: int, batch: int, context: int
) -> list[tuple]:
    """(split, phase, measured ms, predicted ms) for each split's four measured steps."""
    out = []
    for step in steps:
        prefill_units, decode_units = (int(x) for x in step["split_P/D"].split("/"))
        prefill = ExecutionState(prefill_lens=(prefill_len,), prefill_units=prefill_units)
        decode = ExecutionState(decode_ctx=(context,) * batch, decode_units=decode_units)
        both = ExecutionState(
            prefill_lens=(prefill_len,),
            prefill_units=prefill_units,
            decode_ctx=(context,) * batch,
            decode_units=decode_units,
        )
        co = perf.predict(both)
        predicted = {
            "prefill_ms": perf.predict(prefill).prefill_s,
            "prefill_co_ms": co.prefill_s,
            "decode_ms": perf.predict(decode).decode_s,
            "decode_co_ms": co.decode_s,
        }
        for phase, seconds in predicted.items():
            out.append((step["split_P/D"], phase, step[phase], seconds * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="device_check.json with a steps stage")
    parser.add_argument("--hardware", default="h200", help="a preset name or profile JSON")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    steps = json.loads(args.report.read_text())["steps"]
    perf = PerfModel(get_preset(args.model), load_hardware(args.hardware), args.dtype)
    print("| split P/D | step | measured ms | predicted ms | measured / predicted |")
    print("|---|---|---|---|---|")
    for split, phase, measured, predicted in rows(
        steps, perf, args.prefill_len, args.decode_batch, args.context
    ):
        print(
            f"| {split} | {phase} | {measured:.1f} | {predicted:.1f} | {measured / predicted:.2f} |"
        )


if __name__ == "__main__":
    main()
