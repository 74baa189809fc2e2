"""The offline API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.factory import create_engine
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs the engine synchronously over a batch of prompts (continuous batching inside).

    Keyword arguments are EngineConfig fields: `LLM(policy="prefill-first", dtype="float32")`.
    """

    def __init__(
        self, model: str | None = None, policy: str = "chunked", **engine_args: Any
    ) -> None:
        self.engine = create_engine(EngineConfig(model=model, policy=policy, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A bad prompt raises before any request runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        for prompt in prompts:
            self.engine.check_prompt(self.engine.tokenize(prompt))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, param_list, strict=True)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def close(self) -> None:
        """Stop the engine's background work and its other tensor-parallel ranks (they also
        end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
