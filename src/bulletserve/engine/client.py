"""What the API server needs of an engine, wherever the engine runs: in this process
(`AsyncEngine`) or as replicas elsewhere (`replicas.RayReplicas`).

`ModelFront` is the model without its weights (tokenizer, context length, prompt checks), so a
router process that holds no model answers 400s itself; `EngineStats` is what `/metrics` and a
router read of a running engine; `EngineClient` is the interface the server is written against.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.model.loader import load_config
from bulletserve.model.source import ModelSource, resolve_model
from bulletserve.model.tokenizer import load_tokenizer


class PromptTooLongError(ValueError):
    """The prompt does not leave room for a single output token within max_model_len."""


@dataclass
class ModelFront:
    """The model as the API sees it: its name, tokenizer, context length and vocabulary."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    vocab_size: int

    @classmethod
    def load(cls, config: EngineConfig, source: ModelSource | None = None) -> ModelFront:
        """Everything but the weights of the model `--model` names (`source`, if resolved)."""
        source = source or resolve_model(config.model, config.load_format)
        model_config = load_config(source)
        return cls(
            source.name,
            load_tokenizer(config.tokenizer or source),
            config.max_model_len or model_config.max_position_embeddings,
            model_config.vocab_size,
        )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError naming the problem if these prompt tokens cannot be served."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; --max-model-len is {self.max_model_len}, "
                "which leaves no room for output"
            )
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")


@dataclass
class EngineStats:
    """A running engine's queues, KV cache and counters (summed over replicas where several)."""

    num_running: int = 0
    num_waiting: int = 0
    waiting_tokens: int = 0  # prompt tokens of the waiting requests, not yet computed
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # lane -> (units it has now, last relative prediction error); one lane (or replicas): none.
    lane_units: dict[str, tuple[int, float | None]] = field(default_factory=dict)

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(
            self.num_running + other.num_running,
            self.num_waiting + other.num_waiting,
            self.waiting_tokens + other.waiting_tokens,
            self.kv_blocks_used + other.kv_blocks_used,
            self.kv_blocks_total + other.kv_blocks_total,
            self.num_preemptions + other.num_preemptions,
            self.prefix_cache_queries + other.prefix_cache_queries,
            self.prefix_cache_hits + other.prefix_cache_hits,
        )


class EngineClient(Protocol):
    """The engine as the server drives it."""

    @property
    def front(self) -> ModelFront: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def num_running(self) -> int: ...

    def stats(self) -> EngineStats: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def end_streams(self, message: str) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
