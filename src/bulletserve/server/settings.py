"""The server's own settings (the engine's are EngineConfig); light to import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bulletserve.sched.base import SchedulingPolicy
from bulletserve.sched.slo import SLO
from bulletserve.server.reasoning import ReasoningParserName
from bulletserve.server.tools import ToolParserName

DEFAULT_MAX_WAITING_REQUESTS = 1024
# Python's JSON parser holds the interpreter lock while it parses (no thread takes it off the
# event loop): a body of dense JSON (800,000 logit_bias keys, 14 MB) held /health 0.75 s, about
# 55 ms a MB; 4 MiB keeps the worst under 0.25 s and holds a 128K-token prompt as text or ids.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# A request body not wholly received this long after its headers is answered 408 (as the
# headers have a deadline of their own, `server.launch.HEADER_TIMEOUT_S`).
DEFAULT_BODY_TIMEOUT_S = 30.0
STATS_INTERVAL_S = 10.0  # vLLM's: the periodic stats line while the engine is busy


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    # Tool calling (vLLM's flags): whether tool_choice "auto" is served, and the output format
    # tool calls are parsed from (None: read off the chat template).
    enable_auto_tool_choice: bool = False
    # A Jinja chat template (its text) to use instead of the tokenizer's (vLLM's
    # --chat-template, which takes a file or the template inline).
    chat_template: str | None = None
    tool_call_parser: ToolParserName | None = None
    # --reasoning-parser: a reasoning model's output split into reasoning and answer.
    reasoning_parser: ReasoningParserName | None = None
    # --default-chat-template-kwargs: what a request's chat_template_kwargs add to or override.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # A log line per request when it arrives (prompt tokens, sampling settings) and when it
    # ends (vLLM's --enable-log-requests).
    log_requests: bool = False
    # Seconds between the periodic throughput / queue / KV cache lines; 0: none.
    log_stats_interval_s: float = 0.0
    # The engine's --scheduling-policy: under fcfs a request's `priority` must be 0.
    scheduling_policy: SchedulingPolicy = "fcfs"
    # SLO classes a request may name in its `slo` field: "default" (the server's --slo-*
    # flags) and each --slo-class.
    slo_classes: dict[str, SLO] = field(default_factory=dict)
    # --enable-lora's adapters by name (their paths): a request's `model` may name one.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Adapters loaded and unloaded at run time (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    runtime_lora_updates: bool = False
