"""The FastAPI application: routes, error handlers, guards and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

import bulletserve
from bulletserve.engine.client import EngineClient
from bulletserve.server.chat import ChatServing
from bulletserve.server.completions import CompletionServing
from bulletserve.server.http_errors import error_response, install_error_handlers
from bulletserve.server.metrics import ServerMetrics
from bulletserve.server.middleware import GuardMiddleware
from bulletserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from bulletserve.server.serving import Serving, now
from bulletserve.server.settings import ServerSettings
from bulletserve.server.stats_log import StatsLog
from bulletserve.server.tokens import TokenServing

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500)}


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    """The API over a running engine (one in this process, or replicas), which the caller owns
    (and shuts down)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        """The periodic stats line (--disable-log-stats: none) while the app serves."""
        task = None
        if settings.log_stats_interval_s > 0:
            task = asyncio.ensure_future(StatsLog(engine, settings.log_stats_interval_s).run())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(title="bulletserve", version=bulletserve.__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body_bytes=settings.max_request_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    metrics = ServerMetrics(engine, settings.served_model_name, settings.slo_classes.get("default"))
    serving = Serving(engine, settings, metrics)
    completions = CompletionServing(serving)
    chat = ChatServing(serving)
    tokens = TokenServing(chat)
    model_card = ModelCard(
        id=settings.served_model_name,
        created=now(),
        root=engine.front.name,
        max_model_len=engine.front.max_model_len,
    )

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokens.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokens.detokenize(body)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        adapter_cards = [
            ModelCard(
                id=name,
                created=model_card.created,
                root=path,
                parent=settings.served_model_name,
                max_model_len=engine.front.max_model_len,
            )
            for name, path in serving.adapters.items()
        ]
        return ModelList(data=[model_card, *adapter_cards])

    @app.post("/v1/load_lora_adapter", responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        await serving.load_adapter(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        await serving.unload_adapter(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:
            return Response(status_code=200)
        # The fault's details went to the server log when it happened.
        return error_response(503, "the engine has failed: see the server log")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": bulletserve.__version__})

    # What the server runs at its shutdown timeout or when the engine dies: end every open
    # stream with this message; and why the engine has died, if it has (launch.make_server).
    app.state.end_requests = engine.end_streams
    app.state.engine_failure = lambda: engine_failure(engine)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def engine_failure(engine: EngineClient) -> str | None:
    """Why the engine has died, or None while it serves."""
    if engine.healthy:
        return None
    error = engine.error
    return f"{type(error).__name__}: {error}" if error is not None else "it stopped without a word"
