"""A reader that fell behind takes what waits at once, each sample's outputs merged into one."""
import asyncio
import dataclasses

from scheduler_service.api.overload import Overflowed
from scheduler_service.api.streams import take_waiting
from scheduler_service.core.request import FinishReason, RequestOutput, TokenLogprob, Usage
from scheduler_service.text.outputs import merge


def _key(item):
    return item.index if isinstance(item, RequestOutput) else None


def _out(tokens, index=0, final=False):
    return RequestOutput(
        token_ids=list(tokens),
        text="".join(chr(t) for t in tokens),
        index=index,
        finish_reason=FinishReason.LENGTH if final else None,
    )


async def test_a_reader_that_keeps_up_gets_every_output_alone():
    queue: asyncio.Queue = asyncio.Queue()
    first = _out([97])
    assert take_waiting(first, queue, _key, merge) == [first]


async def test_outputs_waiting_merge_per_sample_in_order_and_keep_the_final():
    queue: asyncio.Queue = asyncio.Queue()
    for item in (_out([98], 1), _out([99]), _out([100], 1, final=True), _out([101], final=True)):
        queue.put_nowait(item)
    taken = take_waiting(_out([97]), queue, _key, merge)
    assert queue.empty()
    assert [(o.index, o.token_ids, o.text, o.finish_reason) for o in taken] == [
        (0, [97, 99, 101], "ace", FinishReason.LENGTH),
        (1, [98, 100], "bd", FinishReason.LENGTH),
    ]


async def test_a_marker_is_never_merged_and_stays_after_the_outputs_before_it():
    queue: asyncio.Queue = asyncio.Queue()
    marker = Overflowed("full")
    queue.put_nowait(_out([98]))
    queue.put_nowait(marker)
    taken = take_waiting(_out([97]), queue, _key, merge)
    assert [t.token_ids if isinstance(t, RequestOutput) else t for t in taken] == [[97, 98], marker]


def test_merge_carries_every_field_of_an_output():
    """A field added to RequestOutput and forgotten by merge() fails here."""
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0, queue_time_us=1,
                  time_to_first_token_us=2)
    first = RequestOutput(token_ids=[1], text="a", index=2, logprobs=[TokenLogprob(1, -0.5)],
                          prompt_logprobs=[TokenLogprob(9, -1.0)])
    then = RequestOutput(token_ids=[2], text="b", finish_reason=FinishReason.STOP, stop_match="b",
                         usage=usage, index=2, logprobs=[TokenLogprob(2, -0.25)])
    merged = merge(first, then)
    expected = {
        "token_ids": [1, 2], "text": "ab", "finish_reason": FinishReason.STOP, "stop_match": "b",
        "usage": usage, "index": 2, "logprobs": [TokenLogprob(1, -0.5), TokenLogprob(2, -0.25)],
        "prompt_logprobs": [TokenLogprob(9, -1.0)],
    }
    assert {f.name for f in dataclasses.fields(RequestOutput)} == set(expected)
    assert {name: getattr(merged, name) for name in expected} == expected
