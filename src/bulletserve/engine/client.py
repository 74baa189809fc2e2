"""What the API server needs of an engine, wherever the engine runs: in this process
(`AsyncEngine`) or as replicas elsewhere (`replicas.RayReplicas`).

`ModelFront` is the model without its weights (tokenizer, context length, prompt checks), so a
router process that holds no model answers 400s itself; `EngineStats` is what `/metrics` and a
router read of a running engine; `EngineClient` is the interface the server is written against.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.grammar_limits import GrammarLimits
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingDefaults, SamplingParams
from bulletserve.engine.structured import Grammar, GrammarAfter, GrammarCompiler
from bulletserve.model.loader import load_config
from bulletserve.model.source import ModelSource, resolve_model
from bulletserve.model.tokenizer import load_tokenizer, stop_token_ids
from bulletserve.sched.slo import ServiceClass
from bulletserve.spec.counters import SpecCounters

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt does not leave room for a single output token within max_model_len."""


@dataclass
class ModelFront:
    """The model as the API sees it: its name, tokenizer, context length, vocabulary and the
    token ids that end its turn."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()
    # What a request that leaves out a sampling setting gets (--generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)

    @classmethod
    def load(cls, config: EngineConfig, source: ModelSource | None = None) -> ModelFront:
        """Everything but the weights of the model `--model` names (`source`, if resolved)."""
        source = source or resolve_model(config.model, config.load_format, config.revision)
        model_config = load_config(source)
        tokenizer = load_tokenizer(config.tokenizer or source)
        return cls(
            source.name,
            tokenizer,
            config.max_model_len or model_config.max_position_embeddings,
            model_config.vocab_size,
            stop_token_ids(tokenizer, model_config.eos_token_ids),
            sampling_defaults(config.generation_config, source),
            config.grammar_limits,
        )

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler for this tokenizer and vocabulary (cached grammars)."""
        return GrammarCompiler(
            self.tokenizer, self.vocab_size, self.eos_token_ids, self.grammar_limits
        )

    def close(self) -> None:
        """Stop the grammar compiler processes, where any were started."""
        if "grammars" in self.__dict__:
            self.grammars.close()

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

    def check_sampling(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field whose token ids are outside the vocabulary."""
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size})")

    def decoding_state(self, params: SamplingParams) -> DecodingState:
        """A new request's own decoding state: its grammar's matcher (the grammar compiled, or
        found in the cache) and its bad words as token sequences, each as it tokenizes alone
        and after a space (vLLM's two spellings). Tokenizes and may compile: off the event
        loop where it is heavy (`needs_work_off_loop`)."""
        self.check_sampling(params)
        grammar: Grammar | None = None
        if params.structured_outputs is not None:
            grammar = self.grammars.state(params.structured_outputs)
            if params.reasoning_end is not None:
                # A marker may be a special token: found in the text with them kept.
                decode = partial(self.tokenizer.decode, skip_special_tokens=False)
                grammar = GrammarAfter(grammar, params.reasoning_end, decode)
        spellings = [s for w in params.bad_words for s in (w, " " + w.lstrip(" "))]
        bad_words: dict[tuple[int, ...], None] = {}  # in order, each once
        if spellings:
            encoded = self.tokenizer(spellings, add_special_tokens=False)["input_ids"]
            bad_words.update((tuple(ids), None) for ids in encoded if ids)
        return DecodingState(grammar, [list(ids) for ids in bad_words])


@dataclass
class DecodingState:
    """What a request carries to constrain its tokens (ModelFront.decoding_state)."""

    grammar: Grammar | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)

    @staticmethod
    def needs_work_off_loop(params: SamplingParams) -> bool:
        """Whether building it may take long: a grammar to compile, or words to tokenize."""
        return params.structured_outputs is not None or bool(params.bad_words)


def sampling_defaults(setting: str, source: ModelSource) -> SamplingDefaults:
    """`--generation-config`: `auto`, the model folder's generation_config.json where it has
    one (as vLLM); `vllm`, none; else a folder holding one."""
    if setting == "vllm":
        return SamplingDefaults()
    if setting == "auto":
        folder = source.path if source.path is not None and source.path.is_dir() else None
        if folder is None or not (folder / "generation_config.json").is_file():
            return SamplingDefaults()
    else:
        folder = Path(setting).expanduser()
    defaults = SamplingDefaults.from_file(folder / "generation_config.json")
    if defaults.values:
        settings = ", ".join(f"{k}={v}" for k, v in defaults.values.items())
        logger.info(
            "sampling defaults from the model's generation config: %s (requests that set "
            "them keep theirs; --generation-config vllm ignores the file)",
            settings,
        )
    return defaults


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
    prompt_tokens: int = 0  # computed since start (cached prefixes left out)
    generation_tokens: int = 0  # generated since start
    # lane -> (units it has now, last relative prediction error); one lane (or replicas): none.
    lane_units: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    # Step kind (prefill, fused, decode) -> (predicted, measured) seconds, each a running mean
    # of recent steps: how well the performance model knows the device (bullet only).
    step_times: dict[str, tuple[float, float]] = field(default_factory=dict)
    # SLO class (`ServiceClass.name`) -> requests of it waiting.
    waiting_by_class: dict[str, int] = field(default_factory=dict)
    spec: SpecCounters | None = None  # speculative decoding's (None: it is off)
    # LoRA adapter name -> its requests running and waiting; how many adapters a step may
    # hold (every adapter loaded: no per-step bound); None where LoRA is off.
    running_loras: dict[str, int] = field(default_factory=dict)
    waiting_loras: dict[str, int] = field(default_factory=dict)
    max_loras: int | None = None

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
            self.prompt_tokens + other.prompt_tokens,
            self.generation_tokens + other.generation_tokens,
            waiting_by_class=dict(Counter(self.waiting_by_class) + Counter(other.waiting_by_class)),
            spec=other.spec if self.spec is None else self.spec + (other.spec or SpecCounters()),
            running_loras=dict(Counter(self.running_loras) + Counter(other.running_loras)),
            waiting_loras=dict(Counter(self.waiting_loras) + Counter(other.waiting_loras)),
            max_loras=self.max_loras if other.max_loras is None else other.max_loras,
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

    def describe(self) -> list[str]:
        """What runs, a line a topic (the startup block of `bullet serve`)."""
        ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        service: ServiceClass = ServiceClass(),
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """`LLMEngine.load_lora_adapter`, on every engine behind the client."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """`LLMEngine.unload_lora_adapter`, on every engine behind the client."""
        ...

    def end_streams(self, message: str) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
