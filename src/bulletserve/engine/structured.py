"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression, one of a list of choices, or an EBNF grammar, through xgrammar (the grammar engine
vLLM and SGLang use).

A `StructuredOutputs` is the request's wish, plain data. `GrammarCompiler` (one per tokenizer,
in `ModelFront`) compiles it, cached by the spec, so the server compiles on a worker thread
before the engine sees the request and the engine's own compile is a cache hit. Each request
gets a `GrammarState` (xgrammar's matcher) that the sampler asks for the tokens allowed next
and the engine advances with every token it appends; preemption keeps a request's output
tokens, so the matcher never has to go back.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

StructureKind = Literal["json", "json_object", "regex", "choice", "grammar"]
# Compiled grammars kept per compiler (a schema's compiled form is tens of KB to a few MB).
COMPILED_CACHE_SIZE = 128


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (a 400 at the API)."""


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match: exactly one of the kinds (vLLM's `structured_outputs`)."""

    kind: StructureKind
    spec: str = ""  # the JSON schema (serialized), the regex, or the EBNF grammar; "" otherwise
    choices: tuple[str, ...] = ()

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return cls("json", text)

    def __post_init__(self) -> None:
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise GrammarError("choice needs a non-empty list of non-empty strings")
        elif self.kind in ("json", "regex", "grammar") and not self.spec:
            raise GrammarError(f"structured output {self.kind!r} needs a non-empty spec")


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer and vocabulary (the model's logits width),
    with the model's stop tokens as what ends a complete structure. xgrammar is imported on first
    use (about 3 s), so servers that never see a structured request never pay for it."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: frozenset[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, structure: StructuredOutputs) -> Any:
        """xgrammar's compiled grammar for `structure` (cached); GrammarError if it is invalid."""
        with self._lock:
            if structure in self._cache:
                self._cache.move_to_end(structure)
                return self._cache[structure]
        compiler = self._xgrammar_compiler()
        try:
            compiled = _compile(compiler, structure)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {structure.kind} for structured output: {exc}") from None
        with self._lock:
            self._cache[structure] = compiled
            while len(self._cache) > COMPILED_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, structure: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compile(structure))


def _compile(compiler: Any, structure: StructuredOutputs) -> Any:
    kind = structure.kind
    if kind == "json":
        try:
            json.loads(structure.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON ({exc})") from None
        return compiler.compile_json_schema(structure.spec, any_whitespace=False)
    if kind == "json_object":
        # An object, as OpenAI's json_object means (xgrammar's built-in JSON grammar takes any
        # JSON value, and any run of whitespace between tokens).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(structure.spec)
    if kind == "choice":
        return compiler.compile_regex("|".join(_regex_literal(c) for c in structure.choices))
    return compiler.compile_grammar(structure.spec)


def _regex_literal(text: str) -> str:
    """`text` as a regular expression that matches it alone (xgrammar's regex dialect)."""
    special = set("\\^$.|?*+()[]{}/")
    return "(" + "".join("\\" + ch if ch in special else ch for ch in text) + ")"


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The structure is complete and its stop token accepted: nothing more may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (allocate_bitmask's)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab / 32)] bitmask, bit j of word w allowing token 32 w + j."""
    return torch.zeros(rows, -(-vocab_size // 32), dtype=torch.int32)


_BITS = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32)


def disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool [rows, vocab_size] tensor, True where the bitmask does not allow the token."""
    bits = bitmask.unsqueeze(-1).bitwise_and(_BITS.to(bitmask.device)).eq(0)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]
