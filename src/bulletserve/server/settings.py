"""The server's own settings (the engine's are EngineConfig); light to import."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
