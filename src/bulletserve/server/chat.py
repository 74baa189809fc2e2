"""POST /v1/chat/completions: the tokenizer's chat template, then generation."""

from __future__ import annotations

import jinja2
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from bulletserve.engine.request import RequestOutput, TokenLogprob
from bulletserve.server.errors import APIError
from bulletserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from bulletserve.server.serving import Serving, new_request_id, now, usage


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        """The conversation through the chat template, ending with the assistant's turn."""
        if not messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        if not self.serving.tokenizer.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template", "messages")
        conversation = [m.as_template_input() for m in messages]
        chars = sum(len(m["content"]) for m in conversation)
        self.serving.check_prompt_chars(chars, "messages")
        return await self.serving.off_loop(chars, self._render, conversation)

    def _render(self, conversation: list[dict[str, str]]) -> list[int]:
        tokenizer = self.serving.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as exc:
            raise APIError(
                400, f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        return tokenizer.encode(text, add_special_tokens=False)

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        serving = self.serving
        admission = serving.admit(body)
        try:
            prompt_ids = await self.prompt_ids(body.messages)
            max_tokens = body.max_completion_tokens or body.max_tokens
            num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = serving.sampling_params(body, prompt_ids, max_tokens, num_logprobs)
        except BaseException:
            admission.release()
            raise
        request_id = new_request_id("chatcmpl")
        outputs = serving.outputs(prompt_ids, params, request_id, admission)
        if body.stream:
            events = _ChatEvents(self, request_id, body.include_usage)
            return StreamingResponse(
                serving.stream(outputs, events.deltas, events.final),
                media_type="text/event-stream",
            )
        final = await serving.final_output(request, outputs)
        if final is None:
            return Response(status_code=499)
        choice = ChatChoice(
            message=AssistantMessage(content=final.text),
            logprobs=self.logprobs(final.logprobs) if final.logprobs is not None else None,
            finish_reason=final.finish_reason,
        )
        response = ChatCompletionResponse(
            id=request_id, model=serving.model_name, choices=[choice], usage=usage(final)
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        decode = self.serving.tokenizer.decode

        def entry(token_id: int, logprob: float) -> TopLogprob:
            token = decode([token_id])
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for item in items:
            head = entry(item.token_id, item.logprob)
            top = [entry(t, lp) for t, lp in item.top]
            content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)


class _ChatEvents:
    """The chunks of one streamed chat completion: the role first, then content deltas."""

    def __init__(self, owner: ChatServing, request_id: str, include_usage: bool) -> None:
        self.owner = owner
        self.request_id = request_id
        self.include_usage = include_usage
        self.created = now()
        self.sent_role = False
        self.num_logprobs = 0

    def _chunk(self, choices: list[ChatChunkChoice], output: RequestOutput | None) -> str:
        chunk = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.owner.serving.model_name,
            choices=choices,
            usage=usage(output) if output is not None else None,
        )
        return chunk.model_dump_json()

    def deltas(self, output: RequestOutput) -> list[str]:
        events = []
        if not self.sent_role:
            self.sent_role = True
            role = DeltaMessage(role="assistant", content="")
            events.append(self._chunk([ChatChunkChoice(delta=role)], None))
        if not (output.new_text or output.new_token_ids or output.finished):
            return events
        logprobs = None
        if output.logprobs is not None:
            logprobs = self.owner.logprobs(output.logprobs[self.num_logprobs :])
            self.num_logprobs = len(output.logprobs)
        choice = ChatChunkChoice(
            delta=DeltaMessage(content=output.new_text),
            logprobs=logprobs,
            finish_reason=output.finish_reason if output.finished else None,
        )
        events.append(self._chunk([choice], None))
        return events

    def final(self, output: RequestOutput) -> list[str]:
        return [self._chunk([], output)] if self.include_usage else []
