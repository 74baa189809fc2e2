"""ASGI middleware: the API key on /v1/* and a cap on request body size.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bulletserve.server.errors import error_response


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith("/v1/"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or invalid API key: send `Authorization: Bearer <key>`"
                await error_response(401, message)(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(413, self._too_large_message)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            # Bodies without a length (chunked) are counted as they arrive; the route's error
            # handlers turn the exception into a 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large_message)
            return message

        await self.app(scope, counting_receive, send)

    @property
    def _too_large_message(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes"
