"""POST /v1/completions."""

from __future__ import annotations

from functools import partial

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from bulletserve.engine.request import RequestOutput, TokenLogprob
from bulletserve.server.http_errors import APIError
from bulletserve.server.protocol import (
    MAX_CHOICES,
    ChunkFrame,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from bulletserve.server.serving import (
    ChoiceWork,
    Serving,
    new_request_id,
    now,
    usage,
)


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """One prompt as token ids: the tokenizer's encoding, as the engine does it."""
        if not isinstance(prompt, str):
            return list(prompt)
        self.serving.check_prompt_chars(len(prompt), "prompt")
        return await self.serving.off_loop(
            len(prompt),
            partial(self.serving.tokenizer.encode, add_special_tokens=add_special_tokens),
            prompt,
        )

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        serving = self.serving
        prompts = _prompts(body.prompt)
        width = body.best_of or body.n
        if width * len(prompts) > MAX_CHOICES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x {width} choices is more than {MAX_CHOICES} sequences",
                "n",
            )
        if body.stream and width > body.n:
            raise APIError(400, "best_of greater than n cannot be streamed", "best_of")
        # best_of ranks choices by their tokens' summed logprobs: the engine reports them.
        logprobs = body.logprobs if body.logprobs is not None or width == body.n else 0
        # `echo` with `logprobs` puts the prompt's tokens and logprobs before the output's.
        echo_logprobs = body.echo and body.logprobs is not None
        prompt_logprobs = body.prompt_logprobs
        if echo_logprobs:
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs or 0)
        admission = serving.admit(body, width * len(prompts))
        try:
            service = serving.service(body)
            lora = serving.adapter(body)
            structure = await serving.structure(body, request)
            choices, echoes = [], []
            for p, prompt in enumerate(prompts):
                ids = await self.prompt_ids(prompt, body.add_special_tokens)
                ids = serving.truncated(body, ids)
                params = serving.sampling_params(
                    body, ids, body.max_tokens, logprobs, structure, prompt_logprobs
                )
                echoes.append(_prompt_text(serving, prompt, ids, body) if body.echo else "")
                choices += [
                    ChoiceWork(p * width + k, p, ids, params.for_choice(k), service, lora)
                    for k in range(width)
                ]
        except BaseException:
            admission.release()
            raise
        request_id = new_request_id("cmpl")
        # The client's request_id names the response (as vLLM's); the engine's ids stay unique.
        response_id = f"cmpl-{body.request_id}" if body.request_id else request_id
        outputs = serving.outputs(choices, request_id, admission)
        if body.stream:
            events = _CompletionEvents(
                self,
                response_id,
                body.include_usage,
                body.continuous_usage,
                echoes,
                width,
                body.logprobs if echo_logprobs else None,
            )
            return StreamingResponse(
                serving.stream(outputs, events.deltas, events.final),
                media_type="text/event-stream",
            )
        finals = await serving.final_outputs(request, outputs)
        if finals is None:
            return Response(status_code=499)
        build = partial(
            self._response, body, finals, len(prompts), width, echoes, echo_logprobs, response_id
        )
        logprobs = body.prompt_logprobs is not None or body.logprobs is not None
        return await serving.response(logprobs, build)

    def _response(
        self,
        body: CompletionRequest,
        finals: dict[int, RequestOutput],
        num_prompts: int,
        width: int,
        echoes: list[str],
        echo_logprobs: bool,
        response_id: str,
    ) -> Response:
        serving = self.serving
        kept = _best(finals, num_prompts, width, body.n)
        response_choices = []
        for index, final in enumerate(kept):
            prompt = index // body.n
            # Only a prompt's first choice computed its logprobs (`SamplingParams.for_choice`).
            first = finals[prompt * width]
            logprobs_out = None
            if final.logprobs is not None and body.logprobs is not None:
                logprobs_out = self.logprobs(final.logprobs, 0)
                if echo_logprobs:
                    logprobs_out = self.with_prompt(first, body.logprobs or 0, logprobs_out)
            response_choices.append(
                CompletionChoice(
                    index=index,
                    text=echoes[prompt] + final.text,
                    logprobs=logprobs_out,
                    finish_reason=final.finish_reason,
                    prompt_logprobs=serving.prompt_logprobs(
                        first.prompt_logprobs, body.prompt_logprobs
                    ),
                )
            )
        response = CompletionResponse(
            id=response_id,
            model=serving.model_name,
            choices=response_choices,
            usage=usage([finals[i] for i in sorted(finals)], width),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def logprobs(
        self, items: list[TokenLogprob], text_offset: int, top: int | None = None
    ) -> CompletionLogprobs:
        """The tokens' logprobs in the legacy format, with `top` alternatives (None: all the
        engine gave)."""
        decode = self.serving.tokenizer.decode
        result = CompletionLogprobs()
        for item in items:
            token = decode([item.token_id])
            result.tokens.append(token)
            result.token_logprobs.append(item.logprob)
            result.top_logprobs.append({decode([t]): lp for t, lp in item.top[:top]})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def with_prompt(
        self, prompt_output: RequestOutput, top: int, output: CompletionLogprobs
    ) -> CompletionLogprobs:
        """`output` after the prompt's tokens and logprobs (from the output of the prompt's
        choice that computed them; the first token's are None), its text offsets moved past
        the prompt's text."""
        entries = prompt_output.prompt_logprobs
        assert entries is not None and all(e is not None for e in entries[1:])
        prompt = self.logprobs(entries[1:], 0, top)  # type: ignore[arg-type]
        head = self.serving.tokenizer.decode(prompt_output.prompt_token_ids[:1])
        shift = len(head) + sum(len(t) for t in prompt.tokens)
        return CompletionLogprobs(
            tokens=[head, *prompt.tokens, *output.tokens],
            token_logprobs=[None, *prompt.token_logprobs, *output.token_logprobs],
            top_logprobs=[None, *prompt.top_logprobs, *output.top_logprobs],
            text_offset=[
                0,
                *(offset + len(head) for offset in prompt.text_offset),
                *(offset + shift for offset in output.text_offset),
            ],
        )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: a string or token ids alone, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _prompt_text(
    serving: Serving, prompt: str | list[int], ids: list[int], body: CompletionRequest
) -> str:
    """What `echo` puts before a choice's text: the prompt as sent, or the (kept) token ids
    decoded."""
    if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
        return prompt
    return serving.tokenizer.decode(ids, skip_special_tokens=True)


def _best(
    finals: dict[int, RequestOutput], prompts: int, width: int, n: int
) -> list[RequestOutput]:
    """Per prompt, in order, its n choices: all of them, or (best_of) the n whose tokens have
    the highest summed logprob, best first (as vLLM orders them)."""
    kept = []
    for p in range(prompts):
        group = [finals[p * width + k] for k in range(width)]
        if width > n:
            group.sort(key=lambda out: -sum(lp.logprob for lp in out.logprobs or ()))
        kept += group[:n]
    return kept


class _CompletionEvents:
    """The chunks of one streamed completion, its choices' chunks interleaved."""

    def __init__(
        self,
        owner: CompletionServing,
        request_id: str,
        include_usage: bool,
        continuous_usage: bool,
        echoes: list[str],
        width: int,
        echo_top: int | None,
    ) -> None:
        self.owner = owner
        self.request_id = request_id
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # usage in every chunk, of its choice
        self.created = now()
        self.frame = ChunkFrame(
            CompletionChunk(
                id=request_id, created=self.created, model=owner.serving.model_name, choices=[]
            )
        )
        self.echoes = echoes  # per prompt: what echo puts before each of its choices' text
        self.width = width
        self.echo_top = echo_top  # with echo and logprobs: the prompt's alternatives
        # Per prompt: the first output of the choice that computed its logprobs (the first
        # choice, whose first token comes before any other choice starts).
        self.prompt_outputs: dict[int, RequestOutput] = {}
        self.num_logprobs: dict[int, int] = {}
        self.text_offset: dict[int, int] = {}

    def _chunk(self, choices: list[CompletionChoice], outputs: list[RequestOutput] | None) -> str:
        if outputs is None:
            return self.frame.json(choices)
        chunk = CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.owner.serving.model_name,
            choices=choices,
            usage=usage(outputs, self.width),
        )
        return chunk.model_dump_json()

    def deltas(self, index: int, output: RequestOutput) -> list[str]:
        if not (output.new_text or output.new_token_ids or output.finished):
            return []
        text = output.new_text
        prompt = index // self.width
        first = index not in self.num_logprobs
        if first:
            text = self.echoes[prompt] + text
            self.num_logprobs[index] = 0
            self.text_offset[index] = 0
            if index % self.width == 0:
                self.prompt_outputs[prompt] = output
        logprobs = None
        if output.logprobs is not None:
            seen = self.num_logprobs[index]
            logprobs = self.owner.logprobs(output.logprobs[seen:], self.text_offset[index])
            if first and self.echo_top is not None:
                logprobs = self.owner.with_prompt(
                    self.prompt_outputs[prompt], self.echo_top, logprobs
                )
            self.num_logprobs[index] = len(output.logprobs)
            self.text_offset[index] += sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=output.finish_reason if output.finished else None,
        )
        return [self._chunk([choice], [output] if self.continuous_usage else None)]

    def final(self, outputs: list[RequestOutput]) -> list[str]:
        return [self._chunk([], outputs)] if self.include_usage else []
