"""Structured outputs within bounds: what is refused before compiling, the compile deadline, a
compile its requesters left, the cache's bytes, and shutdown with compiles in flight."""

from __future__ import annotations

import asyncio
import json
import time

import psutil
import pytest

from bulletserve.engine.grammar_limits import (
    MAX_OPTIONAL_PROPERTY_WEIGHT,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_ENUM,
    MAX_SCHEMA_PROPERTIES,
    GrammarLimitError,
    GrammarLimits,
    check_schema,
)
from bulletserve.engine.structured import GrammarCompiler, GrammarError, StructuredOutputs
from tests.tiny_models import needs_default_model

# An EBNF grammar of 21 KB that xgrammar takes about 34 s to compile on one core.
SLOW_GRAMMAR = StructuredOutputs("grammar", "root ::= " + " ".join(["[a-z]*"] * 3000))
INTEGERS = {"type": "array", "items": {"type": "integer"}}

UNENFORCED = {
    "contains": {**INTEGERS, "contains": {"const": 1}},
    "uniqueItems": {**INTEGERS, "uniqueItems": True},
    "allOf": {"allOf": [{"type": "integer"}, {"minimum": 5}]},
    "not": {"not": {"type": "string"}},
    "if": {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCED))
def test_a_schema_keyword_the_grammar_engine_ignores_is_refused_by_name(keyword):
    nested = {"type": "object", "properties": {"field": UNENFORCED[keyword]}}
    with pytest.raises(GrammarLimitError, match=f"'{keyword}' \\(at properties.field\\)"):
        check_schema(nested)


def test_what_the_grammar_engine_enforces_passes():
    pet = {
        "$defs": {
            "Cat": {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind"],
            },
            "Dog": {
                "type": "object",
                "properties": {"kind": {"const": "dog"}, "name": {"type": "string"}},
                "required": ["kind", "name"],
            },
        },
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],  # pydantic's tagged union
    }
    check_schema(pet)
    check_schema({"oneOf": [{"type": "integer"}, {"type": "string"}, {"const": None}]})
    check_schema({"allOf": [{"type": "integer", "minimum": 3}]})
    check_schema({**INTEGERS, "uniqueItems": False, "minItems": 1, "maxItems": 4})
    check_schema({"type": "string", "format": "email", "pattern": "^a", "maxLength": 9})
    check_schema({"type": "object", "enum": [{"not": 1}]})  # a value named like a keyword


def test_a_schema_too_deep_or_too_wide_is_refused_before_compiling():
    deep: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarLimitError, match="levels deep"):
        check_schema(deep)
    names = [f"p{i}" for i in range(MAX_SCHEMA_PROPERTIES + 1)]
    wide = {"type": "object", "properties": dict.fromkeys(names, {}), "required": names}
    with pytest.raises(GrammarLimitError, match="513 properties, more than 512"):
        check_schema(wide)
    with pytest.raises(GrammarLimitError, match="enum"):
        check_schema({"enum": list(range(MAX_SCHEMA_ENUM + 1))})
    very_deep: list = []
    for _ in range(100_000):  # walked without recursion
        very_deep = [very_deep]
    check_schema(very_deep)


def test_optional_properties_are_bounded_by_their_count_times_their_names_length():
    """128 optional properties of 32-character names weigh 2^19, the bound (their compiled
    grammar: 32 MB, 2.3 s from request to grammar on 2 cores); one character more is refused,
    and so is the same weight spread over two objects; required properties weigh nothing."""

    def names(count: int, length: int, tag: str = "") -> list[str]:
        return [(f"{tag}{i:04d}" + "x" * length)[:length] for i in range(count)]

    def obj(properties: list[str], required: list[str] = ()) -> dict:
        return {"type": "object", "properties": dict.fromkeys(properties, {}), "required": required}

    check_schema(obj(names(128, 32)))
    assert 128 * 128 * 32 == MAX_OPTIONAL_PROPERTY_WEIGHT
    heavier = names(128, 32)
    heavier[0] += "y"
    with pytest.raises(GrammarLimitError, match="optional properties weigh 524,416 by its"):
        check_schema(obj(heavier))
    half = obj(names(91, 32, "a"))  # 91 x 91 x 32 = 264,992: two of them pass the bound
    with pytest.raises(GrammarLimitError, match=r"at properties.(first|second), more than 524,288"):
        check_schema({**obj(["first", "second"]), "properties": {"first": half, "second": half}})
    check_schema(obj(names(512, 64), required=names(512, 64)))


@pytest.fixture(scope="module")
def tokenizer():
    from bulletserve.model.tokenizer import load_tokenizer

    return load_tokenizer(None)


def _compiler(tokenizer, **limits: object) -> GrammarCompiler:
    stop = frozenset({tokenizer.eos_token_id})
    return GrammarCompiler(tokenizer, len(tokenizer), stop, GrammarLimits(**limits))


def _worker_pids(compiler: GrammarCompiler) -> set[int]:
    children = psutil.Process().children(recursive=True)
    return {p.pid for p in children if "grammar_worker" in " ".join(p.cmdline())}


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@needs_default_model
def test_a_size_past_the_bound_is_refused_without_compiling(tokenizer):
    compiler = _compiler(tokenizer, max_grammar_bytes=100)
    try:
        with pytest.raises(GrammarError, match="--max-grammar-bytes"):
            compiler.compile(StructuredOutputs("regex", "a" * 101))
        with pytest.raises(GrammarError, match="--max-grammar-bytes"):
            compiler.compile(StructuredOutputs("choice", choices=("x" * 60, "y" * 60)))
        assert not _worker_pids(compiler)  # nothing was started to compile them
    finally:
        compiler.close()


@needs_default_model
@pytest.mark.timeout(120)
def test_a_compile_past_its_deadline_fails_and_its_process_is_killed(tokenizer):
    compiler = _compiler(tokenizer, compile_timeout_s=30.0)
    try:
        compiler.compile(StructuredOutputs("regex", "[0-9]+"))  # the compiler process is up
        (first,) = _worker_pids(compiler)
        compiler.limits = GrammarLimits(compile_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(GrammarError, match="did not compile within 1 s"):
            compiler.compile(SLOW_GRAMMAR)
        assert time.monotonic() - started < 5.0
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
        compiler.limits = GrammarLimits(compile_timeout_s=60.0)
        compiler.compile(StructuredOutputs("regex", "[a-z]+"))  # a new process took over
        assert _worker_pids(compiler) and first not in _worker_pids(compiler)
    finally:
        compiler.close()
    assert _wait_for(lambda: not _worker_pids(compiler), 5.0)


@needs_default_model
@pytest.mark.timeout(120)
def test_a_compile_whose_requester_left_is_stopped(tokenizer):
    compiler = _compiler(tokenizer, compile_timeout_s=60.0)
    try:
        compiler.compile(StructuredOutputs("regex", "[0-9]+"))
        (first,) = _worker_pids(compiler)

        async def leave_early() -> None:
            task = asyncio.ensure_future(compiler.compile_async(SLOW_GRAMMAR))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(leave_early())
        assert _wait_for(lambda: not psutil.pid_exists(first), 2.0)
    finally:
        compiler.close()


@needs_default_model
@pytest.mark.timeout(120)
def test_close_ends_compiles_in_flight_at_once(tokenizer):
    compiler = _compiler(tokenizer, compile_timeout_s=60.0)
    compiler.compile(StructuredOutputs("regex", "[0-9]+"))

    async def close_while_compiling() -> float:
        task = asyncio.ensure_future(compiler.compile_async(SLOW_GRAMMAR))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await asyncio.to_thread(compiler.close)
        with pytest.raises(GrammarError):
            await task
        return time.monotonic() - started

    assert asyncio.run(close_while_compiling()) < 2.0
    assert _wait_for(lambda: not _worker_pids(compiler), 5.0)
    with pytest.raises(GrammarError, match="shutting down"):
        compiler.compile(StructuredOutputs("regex", "[a-z]+"))


@needs_default_model
@pytest.mark.timeout(180)
def test_the_compiled_grammar_cache_is_bounded_in_bytes(tokenizer):
    compiler = _compiler(tokenizer, cache_bytes=100_000)
    try:
        schemas = [
            StructuredOutputs.json_schema(
                {"type": "object", "properties": {f"field{i}": {"type": "integer"}}}
            )
            for i in range(40)
        ]
        for schema in schemas:
            compiler.compile(schema)
            assert 0 < compiler.cache_bytes <= 100_000
        assert compiler._cached(schemas[-1]) is not None
        assert compiler._cached(schemas[0]) is None  # the oldest went first
    finally:
        compiler.close()


def test_a_schema_nested_past_json_s_own_limit_is_an_error_not_a_crash():
    spec = "[" * 100_000 + "]" * 100_000
    limits = GrammarLimits(max_grammar_bytes=1 << 20)  # the parse, not the size, refuses it
    compiler = GrammarCompiler(None, 10, frozenset(), limits)  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="not JSON"):
        compiler.check(StructuredOutputs("json", spec))
    json.dumps({})  # the interpreter is intact
