"""The offline API: `LLM(...).generate(prompts, sampling_params)`, shaped as vLLM's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.factory import create_engine
from bulletserve.engine.lora import LoRARequest
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.sched.base import check_priority
from bulletserve.sched.slo import ServiceClass

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

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given none: the model's generation config's settings
        (`--generation-config`, as vLLM's), ours for the rest."""
        return SamplingParams(**self.engine.front.sampling_defaults.values)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in the order of `prompts`, its `outputs` the prompt's n
        sequences (`SamplingParams.n`, each an engine request of its own; the first's fields
        are also the output's own). `priority`: per prompt, lower first (vLLM's; needs
        `scheduling_policy="priority"`). `lora_request`: the LoRA adapter of every prompt, or
        one per prompt (None: the base model), as vLLM's (needs `enable_lora=True`). A bad
        prompt raises before any request runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            param_list = [sampling_params] * len(prompts)
        else:
            param_list = list(sampling_params)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        for rank in priorities:
            check_priority(rank, self.engine.config.scheduling_policy)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters = [lora_request] * len(prompts)
        else:
            adapters = list(lora_request)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} LoRA requests")
        for prompt in prompts:
            self.engine.check_prompt(self.engine.tokenize(prompt))
        for adapter in adapters:
            self.engine.lora_adapter(adapter)
        ids = [
            [
                self.engine.add_request(
                    prompt,
                    params.for_choice(k),
                    service=ServiceClass(priority=rank),
                    lora_request=adapter,
                )
                for k in range(params.n)
            ]
            for prompt, params, rank, adapter in zip(
                prompts, param_list, priorities, adapters, strict=True
            )
        ]
        group_of = {i: g for g, group in enumerate(ids) for i in group}
        left = [len(group) for group in ids]  # per prompt, its sequences still running
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        group = group_of[output.request_id]
                        left[group] -= 1
                        if not left[group]:
                            bar.update(1)
        return [_gathered([results[i] for i in group]) for group in ids]

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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


def _gathered(sequences: list[RequestOutput]) -> RequestOutput:
    """A prompt's output: its first sequence's, with every sequence in `outputs`, indexed."""
    first = sequences[0]
    if len(sequences) == 1:
        return first
    outputs = [
        dataclasses.replace(output.outputs[0], index=k) for k, output in enumerate(sequences)
    ]
    return dataclasses.replace(first, sequences=outputs)
