"""`bullet perplexity`: a model's perplexity over a text, as llama.cpp's `llama-perplexity`
computes it, for any model and `--quantization` (the measurement itself: accuracy/perplexity.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bulletserve.cli import CLIError, add_model_args


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(
        name,
        help="perplexity over a text (default: the texts shipped in bulletserve/accuracy/texts)",
        description="Tokenizes the text, cuts it into chunks of --ctx-size tokens, runs each "
        "chunk alone and scores the second half of each, as llama-perplexity does: the same "
        "file and text give the same tokens scored by both.",
    )
    add_model_args(parser)
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="as `bullet serve`'s: detected from the checkpoint when omitted; gguf, none",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer folder (default: the model's)"
    )
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file")
    parser.add_argument("--ctx-size", "-c", type=int, default=512, help="tokens a chunk")
    parser.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument(
        "--write-text",
        type=Path,
        default=None,
        help="also write the text scored to this file (the default set as reflowed), to give "
        "llama-perplexity -f the same text",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    from bulletserve.accuracy.perplexity import default_text, perplexity
    from bulletserve.engine.engine import resolve_device
    from bulletserve.model.gguf_reader import GGUFError
    from bulletserve.model.loader import load_model, resolve_dtype
    from bulletserve.model.source import ModelNotFoundError, check_quantization, resolve_model
    from bulletserve.model.tokenizer import load_tokenizer

    if args.chunks is not None and args.chunks < 1:
        raise CLIError(f"--chunks must be >= 1, got {args.chunks}")
    try:
        text = default_text() if args.text is None else args.text.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"--text: cannot read {args.text}: {exc}") from None
    if args.write_text is not None:
        try:
            args.write_text.write_text(text)
        except OSError as exc:
            raise CLIError(
                f"--write-text: cannot write {args.write_text}: {exc.strerror}"
            ) from None
    try:
        check_quantization(args.quantization)
        source = resolve_model(args.model, args.load_format)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        tokenizer = load_tokenizer(args.tokenizer or source)
        tokens = tokenizer(text).input_ids
        adds_bos = bool(tokens) and tokens[0] == tokenizer.bos_token_id
        model = load_model(source, dtype, device, args.ctx_size, quantization=args.quantization)
        result = perplexity(
            model,
            device,
            tokens,
            args.ctx_size,
            tokenizer.bos_token_id if adds_bos else None,
            args.chunks,
        )
    except (ModelNotFoundError, GGUFError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(json.dumps({"model": source.name, **vars(result)} | {"dtype": str(dtype)}))
    else:
        print(
            f"{source.name}: perplexity {result.perplexity:.4f} over {result.scored_tokens} "
            f"tokens ({result.chunks} chunks of {result.context}, {result.text_tokens} in the "
            f"text; {dtype}, {result.seconds:.1f} s)"
        )
    return 0
