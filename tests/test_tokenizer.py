"""Tokenizer loading from the GGUF metadata, and streaming detokenization."""

from __future__ import annotations

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from bulletserve.model.tokenizer import IncrementalDetokenizer, load_tokenizer, stop_token_ids

TOKENIZER = load_tokenizer(None)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
@example("\ufffd")  # found by CI: a genuine replacement character
def test_streamed_deltas_join_to_the_full_text_and_are_never_broken(text):
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assume(TOKENIZER.decode(ids) == text)  # characters outside the vocabulary's bytes do not
    # Text spelling a special token ("<|endoftext|>", found by CI) encodes to it, and streamed
    # output skips special tokens as vLLM's does: the property is about ordinary text.
    assume(not set(ids) & set(TOKENIZER.all_special_ids))
    detok = IncrementalDetokenizer(TOKENIZER, [1, 2, 3])
    deltas = [detok.add(token) for token in ids]
    deltas.append(detok.flush())  # the request finished: nothing may stay held back
    assert "".join(deltas) == text
    if "\ufffd" not in text:  # a genuine U+FFFD in the text is held until the end
        assert not any("\ufffd" in d for d in deltas)


def test_a_genuine_replacement_character_is_flushed_at_the_end():
    ids = TOKENIZER.encode("ok \ufffd", add_special_tokens=False)
    detok = IncrementalDetokenizer(TOKENIZER, [])
    held = "".join(detok.add(token) for token in ids)
    assert held + detok.flush() == "ok \ufffd"
    assert detok.text == "ok \ufffd"


def test_multibyte_characters_are_held_until_complete():
    ids = TOKENIZER.encode("日本語 🤖", add_special_tokens=False)
    detok = IncrementalDetokenizer(TOKENIZER, [])
    deltas = [detok.add(token) for token in ids]
    assert "".join(deltas) == "日本語 🤖"
    assert all(d == "" or "\ufffd" not in d for d in deltas)


def test_chat_template_and_end_of_turn_token():
    messages = [{"role": "user", "content": "Hi"}]
    text = TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    im_end = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stop_token_ids(TOKENIZER, ())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=12))
def test_the_detokenizer_decodes_as_the_tokenizer_does(ids):
    """It decodes through the Rust tokenizer directly where transformers' fast decode adds
    nothing: the text must be the same for any ids, special tokens included."""
    from bulletserve.model.tokenizer import _decoder

    assert _decoder(TOKENIZER)(ids) == TOKENIZER.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_in_the_text_where_a_request_keeps_them():
    """`skip_special_tokens: false` (the mistral tool parser's markers are special tokens)."""
    ids = TOKENIZER.encode("<|im_start|>assistant hi<|im_end|>", add_special_tokens=False)
    kept, skipped = (
        IncrementalDetokenizer(TOKENIZER, [], False),
        IncrementalDetokenizer(TOKENIZER, []),
    )
    for token in ids:
        kept.add(token)
        skipped.add(token)
    kept.flush()
    skipped.flush()
    assert kept.text == "<|im_start|>assistant hi<|im_end|>"
    assert skipped.text == "assistant hi"
