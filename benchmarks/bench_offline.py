"""Offline throughput: bulletserve's LLM.generate vs transformers' batched generate.

Each system runs in its own subprocess (so peak memory is its own), alternating, several
repetitions; the report gives medians and the ratio. Also times single decode steps at batch
1, 16 and 64 against their memory-bandwidth floor.

    python benchmarks/bench_offline.py --repeats 3 --output docs/data/bench_offline.json

Cited in docs/benchmarks.md "Offline throughput".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path


def _prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens cut from varied plain text."""
    words = "the of river mountain quickly seven bright engine garden silver theory".split()
    prompts = []
    for i in range(count):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(length * 2))
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:length])
    return prompts


def run_ours(args: argparse.Namespace) -> dict:
    from bulletserve import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=args.num_prompts)
    prompts = _prompts(llm.tokenizer, args.num_prompts, args.input_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def run_transformers(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bulletserve.model.loader import _converted_gguf, resolve_dtype
    from bulletserve.model.source import default_model_file
    from bulletserve.model.tokenizer import load_tokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tokenizer = load_tokenizer(None)
    folder = _converted_gguf(default_model_file())  # the same weights ours runs
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=resolve_dtype(args.dtype, torch.device("cpu"))
    )
    model.eval()
    prompts = _prompts(tokenizer, args.num_prompts, args.input_len)
    input_ids = torch.tensor(prompts)
    attention_mask = torch.ones_like(input_ids)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2], max_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            **kwargs,
        )
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def run_steps(args: argparse.Namespace) -> dict:
    """Decode step latency at several batch sizes vs bytes-moved / measured bandwidth."""
    import torch

    from bulletserve.engine.config import EngineConfig
    from bulletserve.engine.engine import LLMEngine
    from bulletserve.engine.model_runner import SeqWork

    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_model_len=1024))
    buffer = torch.ones(256 * 2**20, dtype=torch.bfloat16)  # 512 MiB, read once per sum
    buffer.sum()
    reads = []
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        reads.append(time.perf_counter() - start)
    bandwidth = buffer.numel() * 2 / statistics.median(reads)
    config = engine.model_config
    dtype_bytes = torch.finfo(engine.dtype).bits // 8
    weight_bytes = sum(p.numel() for p in engine.model.parameters()) * dtype_bytes
    context = args.input_len + args.output_len // 2
    results = {"bandwidth_GBps": bandwidth / 1e9, "weight_bytes": weight_bytes, "context": context}
    for batch in (1, 16, 64):
        tables = [engine.pool.allocator.allocate(-(-(context + 1) // 16)) for _ in range(batch)]
        works = [SeqWork([100 + i], context, t, True) for i, t in enumerate(tables)]
        engine.runner.execute(works)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            engine.runner.execute(works)
            times.append(time.perf_counter() - start)
        for t in tables:
            engine.pool.allocator.free(t)
        kv_bytes = batch * (context + 1) * config.kv_bytes_per_token(dtype_bytes)
        floor = (weight_bytes + kv_bytes) / bandwidth
        results[f"decode_b{batch}"] = {
            "step_s": statistics.median(times),
            "floor_s": floor,
            "ratio_to_floor": statistics.median(times) / floor,
        }
    return results


def _child(args: argparse.Namespace) -> None:
    result = {"ours": run_ours, "transformers": run_transformers, "steps": run_steps}[args.child](
        args
    )
    result["peak_rss_GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--child", choices=("ours", "transformers", "steps"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    passthrough = [
        f"--num-prompts={args.num_prompts}",
        f"--input-len={args.input_len}",
        f"--output-len={args.output_len}",
        f"--dtype={args.dtype}",
    ]
    runs: dict[str, list[dict]] = {"ours": [], "transformers": [], "steps": []}
    for repeat in range(args.repeats):
        for system in ("ours", "transformers"):
            command = [sys.executable, __file__, f"--child={system}", *passthrough]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat} {system}: {runs[system][-1]}", flush=True)
    command = [sys.executable, __file__, "--child=steps", *passthrough]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    runs["steps"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ours = statistics.median(r["tokens_per_s"] for r in runs["ours"])
    theirs = statistics.median(r["tokens_per_s"] for r in runs["transformers"])
    summary = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "settings": vars(args) | {"output": str(args.output)},
        "ours_tokens_per_s": ours,
        "transformers_tokens_per_s": theirs,
        "ratio": ours / theirs,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    print(json.dumps(runs["steps"][0], indent=2))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
