"""POST /v1/completions."""

from __future__ import annotations

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from bulletserve.engine.request import RequestOutput, TokenLogprob
from bulletserve.server.errors import APIError
from bulletserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from bulletserve.server.serving import Serving, new_request_id, now, usage


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def prompt_ids(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
        """One prompt as token ids: the tokenizer's default encoding, as the engine does it."""
        if isinstance(prompt, list):
            if len(prompt) != 1 and (not prompt or not isinstance(prompt[0], int)):
                raise APIError(
                    400, "send exactly one prompt per request (batched prompts are not supported)",
                    "prompt",
                )  # fmt: skip
            if not isinstance(prompt[0], int):
                prompt = prompt[0]
        if not isinstance(prompt, str):
            return list(prompt)
        self.serving.check_prompt_chars(len(prompt), "prompt")
        return await self.serving.off_loop(len(prompt), self.serving.front.tokenize, prompt)

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        serving = self.serving
        admission = serving.admit(body)
        try:
            prompt_ids = await self.prompt_ids(body.prompt)
            params = serving.sampling_params(body, prompt_ids, body.max_tokens, body.logprobs)
        except BaseException:
            admission.release()
            raise
        request_id = new_request_id("cmpl")
        outputs = serving.outputs(prompt_ids, params, request_id, admission)
        if body.stream:
            events = _CompletionEvents(self, request_id, body.include_usage)
            return StreamingResponse(
                serving.stream(outputs, events.deltas, events.final),
                media_type="text/event-stream",
            )
        final = await serving.final_output(request, outputs)
        if final is None:
            return Response(status_code=499)
        logprobs = None
        if final.logprobs is not None:
            logprobs = self.logprobs(final.logprobs, 0)
        choice = CompletionChoice(
            text=final.text, logprobs=logprobs, finish_reason=final.finish_reason
        )
        response = CompletionResponse(
            id=request_id, model=serving.model_name, choices=[choice], usage=usage(final)
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def logprobs(self, items: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
        decode = self.serving.tokenizer.decode
        result = CompletionLogprobs()
        for item in items:
            token = decode([item.token_id])
            result.tokens.append(token)
            result.token_logprobs.append(item.logprob)
            result.top_logprobs.append({decode([t]): lp for t, lp in item.top})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result


class _CompletionEvents:
    """The chunks of one streamed completion."""

    def __init__(self, owner: CompletionServing, request_id: str, include_usage: bool) -> None:
        self.owner = owner
        self.request_id = request_id
        self.include_usage = include_usage
        self.created = now()
        self.num_logprobs = 0
        self.text_offset = 0

    def _chunk(self, choices: list[CompletionChoice], output: RequestOutput | None) -> str:
        chunk = CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.owner.serving.model_name,
            choices=choices,
            usage=usage(output) if output is not None else None,
        )
        return chunk.model_dump_json()

    def deltas(self, output: RequestOutput) -> list[str]:
        if not (output.new_text or output.new_token_ids or output.finished):
            return []
        logprobs = None
        if output.logprobs is not None:
            logprobs = self.owner.logprobs(output.logprobs[self.num_logprobs :], self.text_offset)
            self.num_logprobs = len(output.logprobs)
            self.text_offset += sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(
            text=output.new_text,
            logprobs=logprobs,
            finish_reason=output.finish_reason if output.finished else None,
        )
        return [self._chunk([choice], None)]

    def final(self, output: RequestOutput) -> list[str]:
        return [self._chunk([], output)] if self.include_usage else []
