"""A stream's chunk frame gives the same bytes as dumping each whole chunk."""

from __future__ import annotations

import pytest

from bulletserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    ChunkFrame,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaMessage,
    Usage,
)

ENVELOPE = {"id": 'cmpl-"quoted"\\id', "created": 1_790_000_000, "model": "models/tiny"}

COMPLETION_CHOICES = [
    [CompletionChoice(index=0, text=" plain")],
    [CompletionChoice(index=3, text='"quotes", \\ and \u00e9\u4e2d\n', finish_reason="stop")],
    [
        CompletionChoice(
            index=1,
            text=" a",
            logprobs=CompletionLogprobs(
                tokens=[" a"], token_logprobs=[-0.5], top_logprobs=[{" a": -0.5}], text_offset=[0]
            ),
        ),
        CompletionChoice(index=2, text="", finish_reason="length"),
    ],
    [],
]

TOKEN = ChatTokenLogprob(token="x", logprob=-1.0, bytes=[120], top_logprobs=[])
CHAT_CHOICES = [
    [ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
    [ChatChunkChoice(index=2, delta=DeltaMessage(content="x"), finish_reason="stop")],
    [
        ChatChunkChoice(
            index=0,
            delta=DeltaMessage(content="x"),
            logprobs=ChatLogprobs(content=[TOKEN]),
        )
    ],
]


@pytest.mark.parametrize("choices", COMPLETION_CHOICES)
def test_a_completion_chunk_through_its_frame_is_the_whole_chunk_dumped(choices):
    frame = ChunkFrame(CompletionChunk(**ENVELOPE, choices=[]))
    assert frame.json(choices) == CompletionChunk(**ENVELOPE, choices=choices).model_dump_json()


@pytest.mark.parametrize("choices", CHAT_CHOICES)
def test_a_chat_chunk_through_its_frame_is_the_whole_chunk_dumped(choices):
    frame = ChunkFrame(ChatCompletionChunk(**ENVELOPE, choices=[]))
    whole = ChatCompletionChunk(**ENVELOPE, choices=choices).model_dump_json()
    assert frame.json(choices) == whole


def test_a_frame_is_made_only_from_a_chunk_without_choices_or_usage():
    with pytest.raises(ValueError, match="without choices and usage"):
        ChunkFrame(CompletionChunk(**ENVELOPE, choices=COMPLETION_CHOICES[0]))
    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    with pytest.raises(ValueError, match="without choices and usage"):
        ChunkFrame(CompletionChunk(**ENVELOPE, choices=[], usage=usage))
