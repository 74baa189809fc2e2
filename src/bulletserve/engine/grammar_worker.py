"""A grammar compiler process (`python -m bulletserve.engine.grammar_worker`): it compiles
structured outputs with xgrammar for the serving process, which kills it when a compile runs
past its deadline or its requester leaves, something a thread could not be made to do.

Messages both ways are a 4-byte big-endian length and that many bytes of JSON. The first one in
is the tokenizer (`xgrammar.TokenizerInfo.serialize_json`); then each is a job, {"kind",
"spec", "choices"}, answered {"compiled": CompiledGrammar.serialize_json} or {"error": text}.
It imports xgrammar alone (no torch), runs at a lower CPU priority than the server's compute,
and exits when its parent is gone.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from typing import IO, Any

# Below the serving threads: a compile waits for the cores rather than slow every step.
NICENESS = 10
PARENT_CHECK_S = 0.5


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_message(stream: IO[bytes], message: object) -> None:
    body = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def compile_structure(compiler: Any, kind: str, spec: str, choices: list[str]) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        # An object, as OpenAI's json_object means (xgrammar's built-in JSON grammar takes any
        # JSON value, and any run of whitespace between tokens).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_regex("|".join(_regex_literal(c) for c in choices))
    return compiler.compile_grammar(spec)


def _regex_literal(text: str) -> str:
    """`text` as a regular expression that matches it alone (xgrammar's regex dialect)."""
    special = set("\\^$.|?*+()[]{}/")
    return "(" + "".join("\\" + ch if ch in special else ch for ch in text) + ")"


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(0)


def main() -> int:
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    import xgrammar

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer = read_message(stdin)
    if tokenizer is None:
        return 0
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer)
    # The serving process keeps the compiled grammars (bounded in bytes); none are kept here.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_message(stdout, {"ready": True})
    while (job := read_message(stdin)) is not None:
        try:
            compiled = compile_structure(compiler, job["kind"], job["spec"], job["choices"])
            reply: dict[str, str] = {"compiled": compiled.serialize_json()}
        except (RuntimeError, ValueError, TypeError) as exc:
            reply = {"error": str(exc)}
        write_message(stdout, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
