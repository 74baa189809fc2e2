"""POST /tokenize and /detokenize, as vLLM's: a prompt or chat messages to token ids (with
the context length), and token ids back to text."""

from __future__ import annotations

from functools import partial

from bulletserve.server.chat import ChatServing
from bulletserve.server.http_errors import APIError
from bulletserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


class TokenServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat
        self.serving = chat.serving

    def _check_model(self, model: str | None) -> None:
        known = (None, self.serving.model_name, *self.serving.adapters)
        if model not in known:
            raise APIError(404, f"the model `{model}` does not exist", "model")

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._check_model(body.model)
        serving = self.serving
        if body.messages is not None:
            ids = await self.chat.prompt_ids(body.messages, body)
        else:
            prompt = body.prompt or ""
            serving.check_prompt_chars(len(prompt), "prompt")
            ids = await serving.off_loop(
                len(prompt),
                partial(serving.tokenizer.encode, add_special_tokens=body.add_special_tokens),
                prompt,
            )
        strs = None
        if body.return_token_strs:
            strs = await serving.off_loop(len(ids), serving.tokenizer.convert_ids_to_tokens, ids)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=serving.front.max_model_len,
            tokens=ids,
            token_strs=strs,
        )

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        vocab = self.serving.front.vocab_size
        if max(body.tokens, default=0) >= vocab:
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        # A long decode (up to MAX_TOKEN_IDS ids) on a worker thread, as a long tokenization.
        text = await self.serving.off_loop(
            len(body.tokens), self.serving.tokenizer.decode, body.tokens
        )
        return DetokenizeResponse(prompt=text)
