"""`bullet generate`: offline generation for one prompt or a file of prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bulletserve.cli import CLIError
from bulletserve.engine.config import EngineConfig, add_engine_args


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(name, help="generate text offline for one or more prompts")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts-file", type=Path, help="a text file, one prompt per line")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(parser)
    parser.set_defaults(run=run)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = args.prompts_file.read_text().splitlines()
    except OSError as exc:
        raise CLIError(f"--prompts-file: cannot read {args.prompts_file}: {exc.strerror}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise CLIError(f"--prompts-file: {args.prompts_file} holds no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    from bulletserve.engine.llm import LLM
    from bulletserve.engine.sampling_params import SamplingParams
    from bulletserve.model.gguf_reader import GGUFError
    from bulletserve.model.source import ModelNotFoundError

    prompts = _read_prompts(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
        )
        config = EngineConfig.from_args(args)
    except ValueError as exc:
        raise CLIError(_flag_message(str(exc))) from None
    try:
        llm = LLM(**vars(config))
        if args.chat:
            outputs = llm.chat(
                [[{"role": "user", "content": p}] for p in prompts], params, len(prompts) > 1
            )
        else:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except (ModelNotFoundError, GGUFError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    for prompt, output in zip(prompts, outputs, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": output.text,
                "token_ids": output.token_ids,
                "finish_reason": output.finish_reason,
                "ttft_s": output.timings.first_token - output.timings.arrival,
                "latency_s": output.timings.finished - output.timings.arrival,
            }
            print(json.dumps(record))
        else:
            if len(prompts) > 1:
                print(f"### {prompt}")
            print(output.text)
    sys.stdout.flush()
    return 0


def _flag_message(message: str) -> str:
    """Sampling errors name the field; say which flag sets it."""
    for field in ("max_tokens", "temperature", "top_p", "top_k"):
        if message.startswith(field):
            return f"--{field.replace('_', '-')}: {message}"
    return message
