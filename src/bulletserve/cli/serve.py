"""`bullet serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
from pathlib import Path
from typing import Literal

from bulletserve.cli import CLIError
from bulletserve.engine.config import EngineConfig, add_engine_args, lora_module
from bulletserve.sched.slo import parse_slo_class
from bulletserve.server.reasoning import REASONING_PARSERS
from bulletserve.server.settings import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    STATS_INTERVAL_S,
    ServerSettings,
)
from bulletserve.server.tools import TOOL_PARSERS

# `--engine-core`: where the engine runs (`engine_core`).
EngineCore = Literal["auto", "thread", "process"]
ENGINE_CORES: tuple[EngineCore, ...] = ("auto", "thread", "process")

logger = logging.getLogger("bulletserve.serve")


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(name, help="serve the OpenAI-compatible API over HTTP")
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: --model)"
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: $BULLET_API_KEY)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="answer 429 while this many requests wait to be scheduled",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="answer 413 to larger request bodies",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them",
    )
    server.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        default="info",
        choices=("debug", "info", "warning", "error"),
    )
    server.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request when it arrives (its id, prompt tokens and sampling settings, "
        "not its text) and when it ends (vLLM's)",
    )
    server.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help="the same as --no-enable-log-requests (vLLM's older spelling)",
    )
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic line of throughput, queues and KV cache usage (vLLM's; by default "
        f"one every {STATS_INTERVAL_S:g} s while the engine is busy)",
    )
    server.add_argument(
        "--slo-class",
        action="append",
        default=[],
        metavar="NAME=TTFT_PER_TOKEN_MS,TPOT_MS[,TTFT_BASE_MS]",
        help="an SLO class a request may name in its `slo` field (repeatable); `default` is "
        "the --slo-* flags' (requests that name none)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template to use instead of the tokenizer's: a file, or the "
        "template itself (as vLLM's)",
    )
    tools = parser.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the model decides whether to call a tool; its calls are '
        'parsed from its text); "required" and a named function work without it',
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default=None,
        help="the format tool calls are parsed from: hermes (Qwen2.5/3, Hermes, SmolLM2), "
        "llama3_json (Llama 3.x), qwen3_coder (Qwen3-Coder's XML) or mistral ([TOOL_CALLS]) "
        "(default: read off the chat template)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's output into `reasoning_content` and `content` (chat "
        "completions): deepseek_r1 (reasoning until </think>) or qwen3 (reasoning only where "
        "the output opens <think>; none with enable_thinking false)",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the chat template's extra inputs by default, e.g. '{\"enable_thinking\": false}' "
        "(a request's chat_template_kwargs override them)",
    )
    parser.add_argument(
        "--engine-core",
        choices=ENGINE_CORES,
        default="auto",
        help="where the engine runs: thread (a thread of the server process), process (a "
        "process of its own, stepping while the server writes tokens); auto: process on a GPU, "
        "thread on a CPU (whose cores the compute takes: there the thread measured faster)",
    )
    replicas = parser.add_argument_group("data-parallel replicas")
    replicas.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="serve N replicas of the engine, each on its own device(s), behind this endpoint "
        "(routed by load and prompt prefix); needs --distributed-executor-backend ray",
    )
    replicas.add_argument(
        "--distributed-executor-backend",
        choices=("ray",),
        default=None,
        help="where the replicas run: ray (`pip install bulletserve[ray]`), on the cluster "
        "RAY_ADDRESS or --ray-address names, else on a Ray instance started on this machine",
    )
    replicas.add_argument("--ray-address", default=None, help="a Ray cluster to join")
    add_engine_args(parser)
    parser.set_defaults(run=run)


def engine_core(setting: EngineCore, device: str) -> EngineCore:
    """`--engine-core` resolved on this machine: auto is a process on a GPU, else a thread."""
    if setting != "auto":
        return setting
    from bulletserve.engine.engine import resolve_device

    return "process" if resolve_device(device).type == "cuda" else "thread"


def _log_to_stderr(level: str) -> None:
    """bulletserve's own log lines (the startup block, the stats, warnings) on stderr beside
    uvicorn's, at --log-level."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(module)s] %(message)s", "%m-%d %H:%M:%S")
    )
    package = logging.getLogger("bulletserve")
    package.addHandler(handler)
    package.setLevel(level.upper())
    package.propagate = False


def _json_object(text: str) -> dict:
    """A flag's JSON object (argparse names the flag where this raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _chat_template(value: str | None) -> str | None:
    """--chat-template's text: a file's, or the value itself where it names no file (a
    template has a `{`, a path none)."""
    if value is None:
        return None
    if "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise CLIError(f"--chat-template {value!r}: no such file (nor a template inline)")
        return path.read_text()
    return value


def _check(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            given = f"{args.model_tag!r} and --model {args.model!r}"
            raise CLIError(f"the model is given twice: {given}")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_waiting_requests", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.shutdown_timeout < 0:
        raise CLIError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.data_parallel_size < 1:
        raise CLIError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    try:
        args.slo_classes = dict(parse_slo_class(text) for text in args.slo_class)
    except ValueError as exc:
        raise CLIError(f"--slo-class: {exc}") from None
    if args.data_parallel_size > 1 and args.engine_core != "auto":
        raise CLIError(
            "--engine-core: each data-parallel replica is a Ray actor's process already; leave "
            "--engine-core out with --data-parallel-size"
        )
    if args.data_parallel_size > 1 and args.distributed_executor_backend != "ray":
        raise CLIError(
            "--data-parallel-size runs its replicas on Ray: add --distributed-executor-backend ray"
        )


def run(args: argparse.Namespace) -> int:
    from bulletserve.engine.async_engine import AsyncEngine
    from bulletserve.engine.client import EngineClient
    from bulletserve.model.gguf_reader import GGUFError
    from bulletserve.model.source import ModelNotFoundError
    from bulletserve.server.app import build_app
    from bulletserve.server.launch import make_server

    _check(args)
    _log_to_stderr(args.log_level)
    chat_template = _chat_template(args.chat_template)
    engine: EngineClient
    try:
        config = EngineConfig.from_args(args)
        if args.data_parallel_size > 1:
            from bulletserve.replicas.ray_replicas import RayReplicas

            engine = RayReplicas(config, args.data_parallel_size, args.ray_address)
        elif engine_core(args.engine_core, config.device) == "process":
            from bulletserve.engine.core_process import CoreProcess

            engine = CoreProcess(config)
        else:
            engine = AsyncEngine(config)
    except (ModelNotFoundError, GGUFError, ValueError) as exc:
        raise CLIError(str(exc)) from exc  # the cause's traceback under --log-level debug
    for line in engine.describe():
        logger.info(line)
    if args.reasoning_parser is not None:
        logger.info(
            "reasoning parser: %s (chat completions' reasoning_content)", args.reasoning_parser
        )
    settings = ServerSettings(
        served_model_name=args.served_model_name or engine.front.name,
        api_key=args.api_key or os.environ.get("BULLET_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests,
        max_request_bytes=args.max_request_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        chat_template=chat_template,
        log_requests=args.enable_log_requests,
        log_stats_interval_s=0.0 if args.disable_log_stats else STATS_INTERVAL_S,
        scheduling_policy=config.scheduling_policy,
        slo_classes={"default": config.slo, **args.slo_classes},
        lora_modules=dict(lora_module(module) for module in config.lora_modules),
        runtime_lora_updates=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
        in ("1", "true"),
    )
    app = build_app(engine, settings)
    # What start-up made (the model's modules, the tokenizer's vocabulary: about 350,000
    # objects) lives as long as the server. Frozen out of the garbage collector, whose full pass
    # over them held the event loop (and /health) 0.18 s whenever a request's allocations set
    # one off.
    gc.collect()
    gc.freeze()
    server = make_server(
        app,
        args.host,
        args.port,
        args.shutdown_timeout,
        args.log_level,
        end_requests=app.state.end_requests,
        engine_failure=app.state.engine_failure,
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    # A dead engine ends the server with a failure, for its supervisor to restart it.
    return 1 if server.engine_failure is not None else 0
