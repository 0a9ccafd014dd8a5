"""A reader that fell behind takes what waits at once, each sample's outputs merged into one."""
import asyncio

from scheduler_service.api.overload import Overflowed
from scheduler_service.api.streams import take_waiting
from scheduler_service.core.request import FinishReason, RequestOutput
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
