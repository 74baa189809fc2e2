"""Speculative decoding at one stream: the embedded model, greedy, with n-gram drafts (every
draft verified, as vLLM; and the drafts the rule finds worth their cost, our default), with
suffix decoding (vLLM's defaults: a trie 24 deep, up to 24 tokens a step) and without, on two
workloads: grounded (copy a passage of one of the package's texts, a different
passage each run) and chat-like (short open questions). The engines run in this process, one
request at a time, alternating, prefix caching off; per workload the median over repeats of
output tokens/s (the whole request: prefill, then decode) and of decode tokens/s (after the
first token), their ratios, the draft acceptance rate and mean acceptance length, and where the
two engines' greedy outputs part (in bf16 they may, at exact ties: a verified row's logits are
rounded after GEMMs over more rows than a decode row's).

    .venv/bin/python benchmarks/bench_spec_decode.py --repeats 5 --max-tokens 128

Each speculating engine's line is followed by its acceptance as `bullet simulate
--spec-acceptance` takes it (the share of decode rows it drafted for, each position's chance).

`--model FOLDER --load-format dummy` runs a model of that folder's shape with random weights,
whose drafts are (almost) never accepted: what speculation costs where it never pays.

Cited in docs/benchmarks.md "Speculative decoding".
"""

from __future__ import annotations

import argparse
import statistics
import time

from bulletserve import LLM, SamplingParams
from bulletserve.accuracy.perplexity import TEXTS
from bulletserve.sim.speculation import AcceptanceTrace

QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for keeping a small garden healthy.",
    "Describe a walk through a busy market in the morning.",
    "What makes a good team leader? Answer in a paragraph.",
    "Plan a simple three-day trip to the mountains.",
    "Write a letter to a friend about learning to cook.",
]


def grounded(run: int, chars: int) -> list[dict[str, str]]:
    text = (TEXTS / "apache-2.0.txt").read_text()
    start = (run * 997) % (len(text) - chars)
    passage = text[start : start + chars]
    return [{"role": "user", "content": "Copy this text exactly, word for word:\n\n" + passage}]


def chat_like(run: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[run % len(QUESTIONS)]}]


def timed(llm: LLM, messages: list[dict[str, str]], params: SamplingParams):
    started = time.perf_counter()
    (output,) = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = output.outputs[0].token_ids
    first = output.timings.first_token - output.timings.arrival
    return len(tokens) / seconds, (len(tokens) - 1) / (seconds - first), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passage-chars", type=int, default=1200)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a draft model (folder, Hugging Face id or GGUF file) of the target's tokenizer: "
        "adds its engines (the rule's drafts and every draft)",
    )
    parser.add_argument(
        "--draft-quantization", default=None, help="the draft's weights, as --quantization"
    )
    parser.add_argument(
        "--suffix-max-spec-factor",
        type=float,
        default=1.0,
        help="suffix decoding's suffix_decoding_max_spec_factor (vLLM's default 1.0: a draft "
        "no longer than the match it follows)",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="which engines beside off, comma-separated from: every draft, adaptive, suffix, "
        "draft model, draft model every draft (default: the first three, and the draft "
        "model's two with --draft-model)",
    )
    args = parser.parse_args()
    config = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    common = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "max_model_len": 2048,
        "enable_prefix_caching": False,
    }
    configs = {
        "every draft": {**config, "adaptive": False},
        "adaptive": config,
        "suffix": {
            "method": "suffix",
            "suffix_decoding_max_spec_factor": args.suffix_max_spec_factor,
        },
    }
    if args.draft_model is not None:
        draft = {
            "method": "draft_model",
            "model": args.draft_model,
            "num_speculative_tokens": args.num_speculative_tokens,
            "quantization": args.draft_quantization,
        }
        configs["draft model"] = draft
        configs["draft model every draft"] = {**draft, "adaptive": False}
    chosen = list(configs) if args.methods is None else args.methods.split(",")
    unknown = [label for label in chosen if label not in configs]
    if unknown:
        parser.error(f"--methods: unknown {unknown[0]!r} (known: {', '.join(configs)})")
    engines = {"off": LLM(**common)}
    for label in chosen:
        engines[label] = LLM(**common, speculative_config=configs[label])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"n-gram: {config}; {args.repeats} runs of {args.max_tokens} tokens, one stream")
    for name in ("grounded", "chat-like"):
        rates: dict[str, list[tuple[float, float]]] = {label: [] for label in engines}
        parted: dict[str, list[int]] = {label: [] for label in engines}
        made: dict[str, int] = {label: 0 for label in engines}  # output tokens
        before = {label: llm.engine.executor.spec_counters() for label, llm in engines.items()}
        for run in range(args.repeats):
            messages = grounded(run, args.passage_chars) if name == "grounded" else chat_like(run)
            want = None
            for label, llm in engines.items():
                *rate, got = timed(llm, messages, params)
                rates[label].append(tuple(rate))
                made[label] += len(got)
                want = got if want is None else want
                if got != want:
                    parted[label].append(
                        next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
                    )
        out_off, dec_off = (statistics.median(r[i] for r in rates["off"]) for i in (0, 1))
        print(f"{name}: off: output tok/s {out_off:.1f}, decode tok/s {dec_off:.1f}")
        for label, llm in engines.items():
            if label == "off":
                continue
            out_on, dec_on = (statistics.median(r[i] for r in rates[label]) for i in (0, 1))
            run = llm.engine.executor.spec_counters() - before[label]
            # Each decode row made its accepted drafts and one token; the first came of the
            # prompt's step.
            decode_rows = made[label] - args.repeats - run.num_accepted_tokens
            print(
                f"  {label}: output tok/s {out_on:.1f} ({out_on / out_off:.2f}x), decode tok/s "
                f"{dec_on:.1f} ({dec_on / dec_off:.2f}x); acceptance "
                f"{run.acceptance_rate or 0:.1%}, mean acceptance length "
                f"{run.mean_acceptance_length or 1:.2f} ({run.num_drafts} "
                f"rows drafted {run.num_draft_tokens} tokens); outputs parted from off in "
                f"{len(parted[label])} of {args.repeats} runs"
                + (f" (at tokens {parted[label]})" if parted[label] else "")
            )
            if run.num_drafts:
                trace = AcceptanceTrace.of_counters(run, decode_rows).flag()
                print(f"    bullet simulate --spec-acceptance {trace}")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
