"""POST /v1/chat/completions: the tokenizer's chat template (with the request's tools), then
generation, then the tool calls parsed out of the text where the request allows them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jinja2
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from bulletserve.engine.request import RequestOutput, TokenLogprob
from bulletserve.server.fields import tools_for_template
from bulletserve.server.http_errors import APIError
from bulletserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTemplateFields,
    ChatTokenLogprob,
    ChunkFrame,
    CompletionTokensDetails,
    DeltaMessage,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from bulletserve.server.reasoning import (
    END,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
    reasoning_tokens,
)
from bulletserve.server.serving import (
    ChoiceWork,
    Serving,
    new_request_id,
    now,
    usage,
)
from bulletserve.server.tools import (
    CallReader,
    CallStream,
    ParsedCall,
    ToolParserName,
    ToolSchemas,
    calls_as_text,
    detect_parser,
    forced_calls,
    may_start_call,
    parse_calls,
    template_takes_tools,
    tools_system_message,
)


@dataclass(frozen=True)
class ToolMode:
    """How a request's output is read for tool calls: `auto` (parsed where the text holds
    them), `required` or `named` (the output is constrained to calls: `fields`)."""

    kind: str  # "auto", "required" or "named"
    parser: ToolParserName
    name: str | None = None  # the named function
    offered: frozenset[str] = frozenset()  # the request's tools' names
    schemas: ToolSchemas = field(default_factory=dict)  # their parameters, by name
    single: bool = False  # parallel_tool_calls false: the first call alone

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output. A forced output cut short (max_tokens) does
        not parse: it stays content, as does text that calls a tool the request did not offer
        (a constraint such as guided_regex can spell one)."""
        if self.kind == "auto":
            content, calls = parse_calls(text, self.parser, self.schemas)
            if any(call.name not in self.offered for call in calls):
                return text, []
            return content, calls[:1] if self.single else calls
        try:
            return None, forced_calls(text, self.name)
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        template = serving.settings.chat_template or serving.tokenizer.chat_template
        self.template = template if isinstance(template, str) else None
        self.takes_tools = template_takes_tools(self.template)
        self.parser = serving.settings.tool_call_parser or detect_parser(self.template)

    async def prompt_ids(self, messages: list[ChatMessage], body: ChatTemplateFields) -> list[int]:
        """The conversation through the chat template (with its tools), ending with the
        assistant's turn (or continuing its last message)."""
        if not self.template:
            raise APIError(400, "this model's tokenizer has no chat template", "messages")
        try:
            return await self._prompt_ids(messages, body)
        except RecursionError:
            # JSON's parser takes lists and objects about 1,000 deep; the template's renderer
            # and encoders recurse, with less room, into tools and chat_template_kwargs.
            raise APIError(
                400, "the chat template's inputs nest too deep (tools, chat_template_kwargs)"
            ) from None

    async def _prompt_ids(self, messages: list[ChatMessage], body: ChatTemplateFields) -> list[int]:
        conversation = [m.as_template_input() for m in messages]
        tools = tools_for_template(body.tools)
        if tools and not self.takes_tools:
            # The template would drop them: they go in a system message instead.
            conversation = _with_system(
                tools_system_message(tools), [calls_as_text(m) for m in conversation]
            )
            tools = None
        size = sum(len(m["content"]) + 16 for m in conversation)
        size += len(json.dumps(tools)) if tools else 0
        size += len(json.dumps(body.chat_template_kwargs)) if body.chat_template_kwargs else 0
        self.serving.check_prompt_chars(size, "messages")
        return await self.serving.off_loop(size, self._render, body, conversation, tools)

    def _render(
        self,
        body: ChatTemplateFields,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        tokenizer = self.serving.tokenizer
        kwargs = self.template_kwargs(body)
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=self.template,
                tools=tools,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **kwargs,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise APIError(
                400, f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    def template_kwargs(self, body: ChatTemplateFields) -> dict[str, Any]:
        """The chat template's extra inputs: --default-chat-template-kwargs, then the
        request's `chat_template_kwargs` over them."""
        return {
            **self.serving.settings.default_chat_template_kwargs,
            **(body.chat_template_kwargs or {}),
        }

    def reasoning_parser(self, body: ChatCompletionRequest) -> ReasoningParser | None:
        """The request's reasoning parser (--reasoning-parser), thinking as its template
        kwargs say (`enable_thinking`)."""
        name = self.serving.settings.reasoning_parser
        if name is None:
            return None
        thinking = self.template_kwargs(body).get("enable_thinking", True) is not False
        return ReasoningParser(name, thinking)

    def tool_mode(self, body: ChatCompletionRequest) -> ToolMode | None:
        choice = body.tool_choice
        if not body.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return ToolMode("named", self.parser, choice.function.name)
        if choice == "required":
            return ToolMode("required", self.parser)  # one call alone: its grammar (`fields`)
        if not self.serving.settings.enable_auto_tool_choice:
            raise APIError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "(and, to override the format read off the chat template, --tool-call-parser); "
                'give tool_choice "required" or a named function, or "none"',
                "tool_choice",
            )
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools}
        return ToolMode(
            "auto",
            self.parser,
            offered=frozenset(schemas),
            schemas=schemas,
            single=body.parallel_tool_calls is False,
        )

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        serving = self.serving
        width = body.best_of or body.n
        if body.stream and width > body.n:
            raise APIError(400, "best_of greater than n cannot be streamed", "best_of")
        mode = self.tool_mode(body)
        reasoning = self.reasoning_parser(body)
        if body.thinking_token_budget is not None and reasoning is None:
            raise APIError(
                400,
                "thinking_token_budget needs a server started with --reasoning-parser",
                "thinking_token_budget",
            )
        admission = serving.admit(body, width)
        try:
            service = serving.service(body)
            structure = await serving.structure(body, request)
            prompt_ids = serving.truncated(body, await self.prompt_ids(body.messages, body))
            max_tokens = body.max_completion_tokens or body.max_tokens
            if body.logprobs:
                num_logprobs: int | None = body.top_logprobs or 0
            else:
                num_logprobs = 0 if width > body.n else None  # best_of ranks by logprobs
            params = serving.sampling_params(body, prompt_ids, max_tokens, num_logprobs, structure)
            if mode is not None and mode.kind == "auto" and mode.parser == "mistral":
                params.skip_special_tokens = False  # its [TOOL_CALLS] marker is one
            if reasoning is not None and reasoning.thinks:
                # The reasoning is free text; the structure holds the answer after it.
                params.reasoning_end = END
                params.thinking_token_budget = body.thinking_token_budget
        except BaseException:
            admission.release()
            raise
        choices = [
            ChoiceWork(k, 0, prompt_ids, params.for_choice(k), service, serving.adapter(body))
            for k in range(width)
        ]
        last = body.messages[-1]
        echo = ""
        if body.echo and last.role == "assistant":
            echo = last.as_template_input()["content"]
        request_id = new_request_id("chatcmpl")
        # The client's request_id names the response (as vLLM's); the engine's ids stay unique.
        response_id = f"chatcmpl-{body.request_id}" if body.request_id else request_id
        outputs = serving.outputs(choices, request_id, admission)
        if body.stream:
            events = _ChatEvents(
                self,
                response_id,
                body.include_usage,
                body.continuous_usage,
                mode,
                echo,
                reasoning,
                body.include_reasoning,
            )
            return StreamingResponse(
                serving.stream(outputs, events.deltas, events.final),
                media_type="text/event-stream",
            )
        finals = await serving.final_outputs(request, outputs)
        if finals is None:
            return Response(status_code=499)
        build = partial(self._response, body, finals, width, mode, echo, response_id, reasoning)
        return await serving.response(body.prompt_logprobs is not None or body.logprobs, build)

    def _response(
        self,
        body: ChatCompletionRequest,
        finals: dict[int, RequestOutput],
        width: int,
        mode: ToolMode | None,
        echo: str,
        response_id: str,
        reasoning: ReasoningParser | None,
    ) -> Response:
        serving = self.serving
        ranked = [finals[k] for k in range(width)]
        if width > body.n:
            ranked.sort(key=lambda out: -sum(lp.logprob for lp in out.logprobs or ()))
        response_choices = []
        for index, final in enumerate(ranked[: body.n]):
            split = ReasoningSplit(None, final.text)
            if reasoning is not None:
                split = reasoning.split(final.text)
            content: str | None = echo + (split.content or "")
            if split.content is None and not echo:
                content = None
            calls: list[ParsedCall] = []
            if mode is not None and split.content is not None:
                content, calls = mode.calls(split.content)
            finish = final.finish_reason
            if calls and mode is not None and mode.kind != "named":
                finish = "tool_calls"
            logprobs = None
            if final.logprobs is not None and body.logprobs:
                logprobs = self.logprobs(final.logprobs)
            shown = split.reasoning if body.include_reasoning else None
            message = AssistantMessage(
                content=content,
                tool_calls=[ToolCallOut(**call.with_id()) for call in calls] or None,
                reasoning_content=shown,
                reasoning=shown,
            )
            response_choices.append(
                ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish)
            )
        response = ChatCompletionResponse(
            id=response_id,
            model=serving.model_name,
            choices=response_choices,
            usage=self.usage(ranked, reasoning),
            # The first choice computed them (SamplingParams.for_choice).
            prompt_logprobs=serving.prompt_logprobs(
                finals[0].prompt_logprobs, body.prompt_logprobs
            ),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def usage(self, outputs: list[RequestOutput], reasoning: ReasoningParser | None) -> Usage:
        """The choices' usage; under a reasoning parser with the reasoning tokens counted."""
        counted = usage(outputs)
        if reasoning is not None:
            decode = self.serving.tokenizer.decode
            spent = sum(
                reasoning_tokens(out.token_ids, reasoning.split(out.text), decode)
                for out in outputs
            )
            counted.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=spent)
        return counted

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


def _with_system(system: dict[str, str], conversation: list[dict[str, Any]]) -> list[dict]:
    """`system` first: merged into the conversation's own system message where it has one."""
    if conversation and conversation[0]["role"] in ("system", "developer"):
        first = dict(conversation[0])
        first["content"] = f"{first['content']}\n\n{system['content']}".strip()
        return [first, *conversation[1:]]
    return [system, *conversation]


@dataclass
class _ChoiceStream:
    """What one streamed choice has sent: its role chunk, how much of its answer, its
    logprobs, and under a reasoning parser how much of each part."""

    sent_role: bool = False
    sent_chars: int = 0
    num_logprobs: int = 0
    reasoning: ReasoningStream | None = None
    content: str = ""  # the answer so far (the whole text without a reasoning parser)
    reader: CallReader | None = None  # the tool calls in the answer so far (a tool mode)
    calls: CallStream = field(default_factory=CallStream.start)  # the tool calls sent so far


class _ChatEvents:
    """The chunks of one streamed chat completion: per choice the role first, then reasoning
    deltas (under a reasoning parser) and content deltas; under a tool mode the answer from
    where a call may start is held back, and at the end it goes out as tool-call deltas (or,
    where it holds no call, as content)."""

    def __init__(
        self,
        owner: ChatServing,
        request_id: str,
        include_usage: bool,
        continuous_usage: bool,
        mode: ToolMode | None,
        echo: str,
        reasoning: ReasoningParser | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self.owner = owner
        self.reasoning = reasoning
        self.request_id = request_id
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # usage in every chunk, of its choice
        self.mode = mode
        self.echo = echo
        self.created = now()
        self.frame = ChunkFrame(
            ChatCompletionChunk(
                id=request_id, created=self.created, model=owner.serving.model_name, choices=[]
            )
        )
        self.choices: dict[int, _ChoiceStream] = {}
        self.include_reasoning = include_reasoning  # false: no reasoning deltas are sent

    def _chunk(self, choices: list[ChatChunkChoice], outputs: list[RequestOutput] | None) -> str:
        if outputs is None:
            return self.frame.json(choices)
        chunk = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.owner.serving.model_name,
            choices=choices,
            usage=self.owner.usage(outputs, self.reasoning),
        )
        return chunk.model_dump_json()

    def deltas(self, index: int, output: RequestOutput) -> list[str]:
        state = self.choices.get(index)
        if state is None:
            mode = self.mode
            state = self.choices[index] = _ChoiceStream(
                reasoning=None if self.reasoning is None else ReasoningStream(self.reasoning),
                reader=None
                if mode is None
                else CallReader(mode.parser, mode.kind, mode.name, mode.schemas),
            )
        so_far = [output] if self.continuous_usage else None
        events = []
        if not state.sent_role:
            state.sent_role = True
            role = DeltaMessage(role="assistant", content=self.echo)
            events.append(self._chunk([ChatChunkChoice(index=index, delta=role)], so_far))
        if not (output.new_text or output.new_token_ids or output.finished):
            return events
        logprobs = None
        if output.logprobs is not None:
            logprobs = self.owner.logprobs(output.logprobs[state.num_logprobs :])
            state.num_logprobs = len(output.logprobs)
        new_reasoning = ""
        if state.reasoning is None:
            state.content = output.text
        else:
            new_reasoning, new_answer = state.reasoning.advance(output.text, output.finished)
            state.content += new_answer
        text, mode = state.content, self.mode
        visible = len(text)
        moved: list[tuple[int, str | None, str | None, str]] = []
        # A call starts in the answer: under a reasoning parser, not before the reasoning ends
        # (a named call's header included).
        answering = state.reasoning is None or state.reasoning.answering
        if mode is not None and state.reader is not None and answering:
            cut = 0 if mode.kind != "auto" else may_start_call(text, mode.parser)
            visible = len(text) if cut is None else max(cut, state.sent_chars)
            offered = mode.offered if mode.kind == "auto" else None
            read = state.reader.read(text)
            moved = state.calls.advance(read[:1] if mode.single else read, offered)
        calls: list[ParsedCall] = []
        if output.finished and mode is not None:
            _, calls = mode.calls(text)
            if not calls and not state.calls.ids:
                visible = len(text)  # no call after all: the held text is content
        delta = DeltaMessage(content=text[state.sent_chars : visible])
        if new_reasoning and self.include_reasoning:
            delta.reasoning_content = delta.reasoning = new_reasoning
            if visible == state.sent_chars:
                delta.content = None  # a reasoning delta alone
        state.sent_chars = visible
        finish = output.finish_reason if output.finished else None
        if moved:
            delta.tool_calls = [
                ToolCallDelta(
                    index=i,
                    id=call_id,
                    type="function" if call_id is not None else None,
                    function=FunctionCallDelta(name=name, arguments=arguments),
                )
                for i, call_id, name, arguments in moved
            ]
            if not delta.content:
                delta.content = None
        if (calls or state.calls.ids) and mode is not None and mode.kind != "named" and finish:
            finish = "tool_calls"
        if not (delta.content or delta.reasoning or delta.tool_calls or finish or logprobs):
            return events  # nothing new to say: no empty chunk
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        events.append(self._chunk([choice], so_far))
        return events

    def final(self, outputs: list[RequestOutput]) -> list[str]:
        return [self._chunk([], outputs)] if self.include_usage else []
