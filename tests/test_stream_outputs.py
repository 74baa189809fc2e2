"""A stream's queued outputs: those that queued while the event loop was busy go out as one,
with every new token since the last; an exception in the queue comes in its turn."""

from __future__ import annotations

import asyncio

import pytest

from bulletserve.engine.request import RequestOutput, RequestTimings
from bulletserve.engine.streams import stream_outputs


def _output(tokens: list[int], new: int, finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2],
        text=text,
        token_ids=tokens,
        new_text="".join(f"<{t}>" for t in tokens[-new:]),
        new_token_ids=tokens[-new:],
        finished=finished,
        finish_reason="length" if finished else None,
        logprobs=None,
        timings=RequestTimings(0.0),
    )


async def _drain(items: list[object], read_first: bool) -> list[RequestOutput | str]:
    """Put `items` in a queue (after the first has been read where `read_first`), and gather
    what the stream yields, an exception as its message."""
    queue: asyncio.Queue = asyncio.Queue()
    got: list[RequestOutput | str] = []
    stream = stream_outputs(queue)
    rest = items
    if read_first:
        queue.put_nowait(items[0])
        got.append(await anext(stream))
        rest = items[1:]
    for item in rest:
        queue.put_nowait(item)
    try:
        async with asyncio.timeout(5):
            async for output in stream:
                got.append(output)
    except RuntimeError as exc:
        got.append(str(exc))
    return got


def test_outputs_queued_together_go_out_as_one_with_every_new_token():
    async def first_two() -> list[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        stream = stream_outputs(queue)
        queue.put_nowait(_output([5], 1))
        first = await anext(stream)
        for tokens in ([5, 6], [5, 6, 7], [5, 6, 7, 8]):
            queue.put_nowait(_output(tokens, 1))
        second = await asyncio.wait_for(anext(stream), 5)
        await stream.aclose()
        return [first, second]

    got = asyncio.run(first_two())
    assert [o.new_token_ids for o in got] == [[5], [6, 7, 8]]
    assert got[1].new_text == "<6><7><8>" and got[1].text == "<5><6><7><8>"
    assert got[1].token_ids == [5, 6, 7, 8] and not got[1].finished


def test_the_finished_output_ends_the_stream_and_is_merged_into():
    items = [_output([5], 1), _output([5, 6], 1), _output([5, 6, 7], 1, finished=True)]
    got = asyncio.run(_drain(items, read_first=False))
    assert len(got) == 1 and got[0].finished and got[0].new_token_ids == [5, 6, 7]
    assert got[0].finish_reason == "length"


def test_an_exception_after_queued_outputs_comes_after_them():
    items = [_output([5], 1), _output([5, 6], 1), RuntimeError("engine fault"), _output([9], 1)]
    got = asyncio.run(_drain(items, read_first=False))
    assert [o if isinstance(o, str) else o.new_token_ids for o in got] == [[5, 6], "engine fault"]


@pytest.mark.parametrize("read_first", [False, True])
def test_an_exception_first_is_raised_at_once(read_first):
    items = [_output([5], 1), RuntimeError("gone")] if read_first else [RuntimeError("gone")]
    got = asyncio.run(_drain(items, read_first=read_first))
    assert got[-1] == "gone"
