"""ASGI middleware: the API key on /v1/*, a cap on request body size and a deadline for the
body.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streamed responses pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bulletserve.server.http_errors import error_response


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"].startswith("/v1/"):
            # RFC 7235: the scheme is case-insensitive ("bearer KEY" too).
            scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
            given = credentials.strip() if scheme.lower() == b"bearer" else b""
            if not hmac.compare_digest(given, self.key):
                message = "missing or invalid API key: send `Authorization: Bearer <key>`"
                await error_response(401, message)(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(413, self._too_large_message)(scope, receive, send)
            return
        received = 0
        complete = False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def guarded_receive() -> Message:
            # Until the body is complete, each part must come before the body's deadline (a
            # client that stalls mid-body would otherwise hold its connection); afterwards the
            # app awaits only the client's disconnect. Bodies without a length (chunked) are
            # counted as they arrive. The route's error handlers answer the exceptions.
            nonlocal received, complete
            if complete:
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large_message)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded_receive, send)

    @property
    def _too_large_message(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes"
