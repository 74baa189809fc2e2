"""Request and response bodies of the OpenAI-compatible API (plus vLLM's extras).

One rule for fields: every field of OpenAI's and vLLM's requests that we implement is declared
here; a field vLLM implements and we do not is refused with a 400 naming it (`REFUSED`, unless
it holds vLLM's default, which asks for nothing); any other field (one vLLM ignores too) is
ignored and logged once per field name, as vLLM does. docs/api.md has the whole table.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from bulletserve.sched.slo import MIN_TARGET_MS

SEED_RANGE = {"ge": -(2**63), "le": 2**64 - 1}  # what torch.Generator.manual_seed accepts
# Choices one request may ask for (n, best_of, prompts x n): a bound, so that one request
# cannot queue thousands of sequences.
MAX_CHOICES = 128

# Fields vLLM implements that we do not (yet), with the value that asks for nothing: a request
# that sets one to anything else is refused (400 naming it).
REFUSED: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "spaces_between_special_tokens": True,
    "prompt_embeds": None,
    "suffix": None,
    "documents": None,
    "chat_template": None,
    "mm_processor_kwargs": None,
    "structural_tag": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "return_tokens_as_token_ids": None,
    "return_token_ids": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "reasoning_effort": None,
}


# Bounds on a chat body's structure, checked before it is validated: pydantic validates on the
# event loop and holds the GIL throughout (400,000 empty messages, 13 MB: 0.8 s in which
# nothing else on the server ran). No context holds more messages than this, each costing
# template tokens.
MAX_MESSAGES = 16384
MAX_MESSAGE_ITEMS = 16384  # content parts and tool calls, over all messages
MAX_TOOLS = 1024
# Bounds on the list fields, checked (by length alone) before any is walked. A bad word is
# tokenized twice and scanned for at every step; a logit_bias or allowed_token_ids entry is a
# token id, and no vocabulary has more than a few hundred thousand.
MAX_LIST_ITEMS: dict[str, int] = {
    "logit_bias": 1024,
    "allowed_token_ids": 262_144,
    "bad_words": 1024,
    "stop": 256,
    "stop_token_ids": 1024,
}
# Token ids a body may carry: a completion's prompts (all of them) or /detokenize's tokens.
MAX_TOKEN_IDS = 1 << 20
# How deep the free-form fields (schemas, tools, chat_template_kwargs) may nest. JSON's parser
# takes about 1,000 levels; the chat template's renderer, pydantic's serializer and JSON's
# encoder each recurse into them with less room than that.
MAX_NESTING = 128
FREE_FORM_FIELDS = (
    "tools",
    "chat_template_kwargs",
    "response_format",
    "structured_outputs",
    "guided_json",
)


class BodyError(Exception):
    """A request body the server refuses before validating it: a string that is not valid
    Unicode text (JSON's `"\\ud800"` escapes give Python a lone UTF-16 surrogate, which no
    tokenizer or UTF-8 encoder takes), or a structure past the bounds above. Raised (not a
    ValueError, so pydantic lets it through) from a body's validation; the server answers it
    with a 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_structure(body: object) -> None:
    """Raise BodyError where a body has more messages, content parts and tool calls, tools,
    list items or token ids than the bounds (counted in a few ms: lists' lengths, one pass over
    the messages)."""
    if not isinstance(body, dict):
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise BodyError("messages", f"messages: {len(messages)} is more than {MAX_MESSAGES}")
        items = sum(
            len(value)
            for message in messages
            if isinstance(message, dict)
            for value in (message.get("content"), message.get("tool_calls"))
            if isinstance(value, list)
        )
        if items > MAX_MESSAGE_ITEMS:
            raise BodyError(
                "messages",
                f"messages: {items} content parts and tool calls is more than {MAX_MESSAGE_ITEMS}",
            )
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise BodyError("tools", f"tools: {len(tools)} is more than {MAX_TOOLS}")
    for name, limit in MAX_LIST_ITEMS.items():
        value = body.get(name)
        if isinstance(value, list | dict) and len(value) > limit:
            raise BodyError(name, f"{name}: {len(value)} items is more than {limit}")
    for name in ("prompt", "tokens"):
        value = body.get(name)
        if isinstance(value, list):
            ids = sum(len(item) if isinstance(item, list) else 1 for item in value)
            if ids > MAX_TOKEN_IDS:
                raise BodyError(name, f"{name}: {ids} token ids is more than {MAX_TOKEN_IDS}")
    for name in FREE_FORM_FIELDS:
        if _nests_deeper(body.get(name), MAX_NESTING):
            raise BodyError(name, f"{name}: nests more than {MAX_NESTING} levels deep")


def _nests_deeper(value: object, limit: int) -> bool:
    """Whether `value` holds lists and objects more than `limit` deep (walked without
    recursion, stopping at the first that is)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend(
                (child, depth + 1) for child in item.values() if isinstance(child, dict | list)
            )
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))
    return False


def check_text(body: object) -> None:
    """Raise BodyError naming the first string of `body` (parsed JSON: dicts,
    lists, scalars) that does not encode to UTF-8."""
    try:
        # The whole body through C first (a body of 400,000 empty messages, 13 MB: 0.16 s,
        # where the walk below took 0.58 s); the walk finds the culprit's path, or checks what
        # is not JSON (models built in code).
        json.dumps(body, ensure_ascii=False, check_circular=False).encode("utf-8")
        return
    except (UnicodeEncodeError, TypeError):
        pass
    except RecursionError:
        # Nested almost as deep as JSON's parser allows: too deep for the encoder here.
        raise BodyError("body", "the body nests too deep (lists and objects)") from None
    stack: list[tuple[object, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                raise _unencodable(path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(str(key)):  # named by its object: the key cannot be shown
                    raise _unencodable(f"{path or 'body'} (a key)")
                stack.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{index}") for index, item in enumerate(value))


def _unencodable(path: str) -> BodyError:
    return BodyError(path, f"{path}: a lone UTF-16 surrogate is not valid text")


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Request(BaseModel):
    # Strict, as OpenAI's API is: "10" is not a number, "yes" not a boolean. Extra fields are
    # kept (`model_extra`) for the server's one rule (REFUSED, or ignored and logged).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class _Body(_Request):
    """A whole request body: its structure checked against the bounds, then every string in
    it, at any depth, checked once to be text."""

    @model_validator(mode="before")
    @classmethod
    def _bounded_text(cls, data: Any) -> Any:
        check_structure(data)
        check_text(data)
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None


class SLOTargets(BaseModel):
    """A request's own SLO: TTFT per prompt token (plus an optional fixed part) and TPOT, ms."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    ttft_per_token_ms: Annotated[float, Field(ge=MIN_TARGET_MS, le=1e6)]
    tpot_ms: Annotated[float, Field(ge=MIN_TARGET_MS, le=1e6)]
    ttft_base_ms: Annotated[float, Field(ge=0, le=1e7)] = 0.0


class SamplingFields(_Body):
    """Fields that both endpoints share."""

    model: str | None = None  # None: the served model
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    skip_special_tokens: bool = True  # False: the output's text keeps special tokens
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(**SEED_RANGE)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = (
        None
    )
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None
    ) = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # vLLM's: lower runs first (needs --scheduling-policy priority unless 0).
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    # Ours: the request's latency targets, a class the server was started with (--slo-class)
    # or targets of its own.
    slo: Annotated[str, Field(min_length=1)] | SLOTargets | None = None

    @field_validator("slo", mode="before")
    @classmethod
    def _slo_targets(cls, value: object) -> object:
        """A class name or an object of targets, each with its own errors (not the union's)."""
        if value is None or (isinstance(value, str) and value):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "expected an SLO class's name or {ttft_per_token_ms, tpot_ms[, ttft_base_ms]}"
            )
        try:
            return SLOTargets.model_validate(value)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ValueError(f"{where}: {error['msg']}") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: usage in every chunk (with include_usage)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    @model_validator(mode="after")
    def _choices(self) -> SamplingFields:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM: they would come whole in the first chunk, before any token.
            raise ValueError("prompt_logprobs are not available with stream=true")
        return self


class CompletionRequest(SamplingFields):
    # A string, token ids, or a list of either (one choice set per prompt).
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
        | list[int]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    add_special_tokens: bool = True


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # As Hugging Face chat templates take them: arguments as an object where they parse.
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(_Body):
    """What the chat template is rendered with, beside the messages (chat and /tokenize)."""

    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False
    # At most this many tokens of reasoning, then its end is forced (--reasoning-parser).
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    include_reasoning: bool = True  # false: the reasoning is left out of the reply

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or ()}
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, not one of tools")
        return self


class TokenizeRequest(ChatTemplateFields):
    """vLLM's POST /tokenize: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class LoadLoRAAdapterRequest(_Body):
    """vLLM's `POST /v1/load_lora_adapter`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's `POST /v1/unload_lora_adapter`."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Under --reasoning-parser: how many completion tokens were reasoning.
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    # None for the first prompt token where `echo` puts the prompt's logprobs first.
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's `prompt_logprobs`: the token and each alternative."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token (None for the first): token id -> its logprob, rank and text.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    # Under --reasoning-parser, the reasoning under both names clients read (vLLM renamed it).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class _LeavesOutNone(BaseModel):
    """A part of a streamed delta: a field it does not carry is left out, as OpenAI's are (a
    client that merges deltas, the openai SDK's stream helpers, takes a null for a value)."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionCallDelta(_LeavesOutNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_LeavesOutNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(_LeavesOutNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChunkFrame:
    """A streamed response's chunks without usage differ only in their choices: everything
    around them (id, object, created, model, usage null) is serialized once from the stream's
    chunk with no choices, and each chunk is that text with its choices' JSON inside: the same
    bytes as dumping the whole chunk, for about half the time (it is made for every stream at
    every step)."""

    _CHOICES = '"choices":[]'

    def __init__(self, empty: CompletionChunk | ChatCompletionChunk) -> None:
        if empty.choices or empty.usage is not None:
            raise ValueError("a chunk frame is made from a chunk without choices and usage")
        head, marker, tail = empty.model_dump_json().partition(self._CHOICES)
        if not marker:
            raise ValueError(f"{type(empty).__name__} serializes no {self._CHOICES}")
        self._head = head + self._CHOICES[:-1]
        self._tail = "]" + tail

    def json(self, choices: list[CompletionChoice] | list[ChatChunkChoice]) -> str:
        return self._head + ",".join(c.model_dump_json() for c in choices) + self._tail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bulletserve"
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
