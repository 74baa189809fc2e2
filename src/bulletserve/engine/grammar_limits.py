"""What a structured output may ask of the grammar engine, checked before anything is compiled:
its size, how deep a JSON schema nests and how wide it gets, and the schema keywords xgrammar
enforces. A schema using a keyword xgrammar would silently ignore is refused, naming the
keyword, rather than served with outputs that break it (vLLM checks the same way).

Each bound comes from measured compile times on the embedded model's tokenizer (49,152
tokens, xgrammar 0.2.9, one core): an object of 1,000 optional properties took 0.9 s and
2,000 took 35 s; an enum of 20,000 strings 4.9 s; objects nested 128 deep 0.4 s and 320 deep
3.2 s. What a compile costs the server is more than xgrammar's compile: the compiled grammar
comes back from its compiler process serialized, and for optional properties its size grows as
their count times their names' total length (every subset of them is a state with its own token
masks): 512 optional properties of 4-character names serialize to 96 MB of JSON, 10.7 s on a
2-core AMD EPYC guest from request to grammar; 128 of 32 characters (a product of 2^19) to 32 MB,
2.3 s. So the sum over a schema's objects of optional properties x their names' characters is
bounded by `MAX_OPTIONAL_PROPERTY_WEIGHT`, a quarter of the default deadline. The compile
deadline (`GrammarLimits.compile_timeout_s`) bounds whatever slips past them all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_GRAMMAR_BYTES = 64 * 1024
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_GRAMMAR_CACHE_MB = 256
DEFAULT_COMPILE_WORKERS = 1
# Fixed bounds on a JSON schema's shape (see the module's note).
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_PROPERTIES = 512  # properties of one object
MAX_SCHEMA_ENUM = 4096  # values of one enum
# Over a whole schema, each object's optional properties x their names' characters, summed.
MAX_OPTIONAL_PROPERTY_WEIGHT = 1 << 19
# Keywords xgrammar 0.2.9 accepts and does not enforce: each was checked with an output that
# breaks it and that the compiled grammar allowed. `format` values it does not know, and the
# content* annotations, are annotations in JSON Schema 2020-12 and stay accepted.
UNENFORCED_KEYWORDS = (
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)


class GrammarLimitError(ValueError):
    """A structured output past a bound, or asking for what the grammar engine cannot enforce."""


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds on compiling structured outputs (the flags `bullet serve` takes)."""

    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # a schema, regex, grammar or choices
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # one compile, once a process has it
    cache_bytes: int = DEFAULT_GRAMMAR_CACHE_MB * 1024 * 1024  # compiled grammars kept
    compile_workers: int = DEFAULT_COMPILE_WORKERS  # compiler processes

    def __post_init__(self) -> None:
        if self.max_grammar_bytes < 1:
            raise ValueError(f"--max-grammar-bytes must be >= 1, got {self.max_grammar_bytes}")
        if not self.compile_timeout_s > 0:
            raise ValueError(
                f"--grammar-compile-timeout must be > 0 s, got {self.compile_timeout_s}"
            )
        if self.cache_bytes < 0:
            raise ValueError(f"--grammar-cache-mb must be >= 0, got {self.cache_bytes}")
        if self.compile_workers < 1:
            raise ValueError(f"--grammar-compile-workers must be >= 1, got {self.compile_workers}")


def check_size(kind: str, size: int, limits: GrammarLimits) -> None:
    if size > limits.max_grammar_bytes:
        raise GrammarLimitError(
            f"the {kind} has {size} bytes, more than --max-grammar-bytes "
            f"({limits.max_grammar_bytes})"
        )


def check_schema(schema: Any) -> None:
    """Raise GrammarLimitError where a JSON schema nests or widens past the bounds, or uses a
    keyword xgrammar does not enforce; walked without recursion, so no depth overflows it."""
    root = schema if isinstance(schema, dict) else {}
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    weight = 0
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}.{i}", depth) for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarLimitError(
                f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep (at {path or 'top'})"
            )
        _check_keywords(node, path or "the top level", root)
        weight += _optional_property_weight(node)
        if weight > MAX_OPTIONAL_PROPERTY_WEIGHT:
            raise GrammarLimitError(
                f"the schema's optional properties weigh {weight:,} by its object at "
                f"{path or 'the top level'}, more than {MAX_OPTIONAL_PROPERTY_WEIGHT:,} (an "
                "object's optional properties x their names' characters, summed over the "
                "schema): the compiled grammar would be too large; make properties required "
                "or the object smaller"
            )
        for key, value in node.items():
            if key in ("enum", "const", "default", "examples", "required"):
                continue  # values, not subschemas
            if isinstance(value, dict | list):
                stack.append((value, f"{path}.{key}" if path else key, depth + 1))


def _optional_property_weight(node: dict[str, Any]) -> int:
    """An object's optional properties x their names' characters (see the module's note)."""
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return 0
    required = node.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    optional = [name for name in properties if name not in required]
    return len(optional) * sum(len(name) for name in optional)


def _check_keywords(node: dict[str, Any], where: str, root: dict[str, Any]) -> None:
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in node:
            raise _unenforced(keyword, where)
    if node.get("uniqueItems") is True:
        raise _unenforced("uniqueItems", where)
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise _unenforced("allOf", where, " with more than one part (merge them into one)")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of, root):
        raise _unenforced(
            "oneOf",
            where,
            " whose alternatives may overlap (it is enforced as anyOf: give the alternatives "
            "distinct types or a property each requires with a distinct const, or use anyOf)",
        )
    properties = node.get("properties")
    if isinstance(properties, dict) and len(properties) > MAX_SCHEMA_PROPERTIES:
        raise GrammarLimitError(
            f"the schema's object at {where} has {len(properties)} properties, more than "
            f"{MAX_SCHEMA_PROPERTIES}"
        )
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_SCHEMA_ENUM:
        raise GrammarLimitError(
            f"the schema's enum at {where} has {len(enum)} values, more than {MAX_SCHEMA_ENUM}"
        )


def _unenforced(keyword: str, where: str, detail: str = "") -> GrammarLimitError:
    return GrammarLimitError(
        f"the JSON schema keyword {keyword!r} (at {where}){detail} is not enforced by the "
        "grammar engine: the output could break it, so the schema is refused"
    )


_TYPE_OVERLAPS = {"integer": {"number"}, "number": {"integer"}}


def _disjoint(alternatives: list[Any], root: dict[str, Any]) -> bool:
    """Whether no JSON value can match two of `alternatives`, judged from what is cheap to see:
    their `type`s, or a property each requires with its own `const` (a discriminator, as
    pydantic writes tagged unions); local `$ref`s are followed."""
    alternatives = [_resolved(a, root) for a in alternatives]
    if not all(isinstance(a, dict) for a in alternatives):
        return False
    types = [_types(a) for a in alternatives]
    if all(t is not None for t in types):
        seen: set[str] = set()
        for kinds in types:
            assert kinds is not None
            widened = kinds | {o for k in kinds for o in _TYPE_OVERLAPS.get(k, ())}
            if widened & seen:
                break
            seen |= kinds
        else:
            return True
    return _discriminated(alternatives)


def _resolved(schema: Any, root: dict[str, Any]) -> Any:
    """`schema`, or what its local `$ref` ("#/$defs/Name") points to (a few hops at most)."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#/")):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        schema = target
    return schema


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    if "const" in schema:
        return {_json_type(schema["const"])}
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _discriminated(alternatives: list[dict[str, Any]]) -> bool:
    required = [
        {r for r in a.get("required") or () if isinstance(r, str)}
        if isinstance(a.get("required"), list)
        else set()
        for a in alternatives
    ]
    for name in set.intersection(*required):
        values = []
        for alternative in alternatives:
            spec = (alternative.get("properties") or {}).get(name)
            if not isinstance(spec, dict) or "const" not in spec:
                break
            values.append(json.dumps(spec["const"], sort_keys=True))
        else:
            if len(set(values)) == len(values):
                return True
    return False
