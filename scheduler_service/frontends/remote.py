"""The engine side as a frontend process sees it: `RemoteEngine`, an EngineFrontend
(engine/frontend.py) over the link to the engine core.

Adding and aborting send a message (the core answers an add over the queue's bounds with its
refusal: on_refused); what the doors read of the scheduler (queue depth, KV figures, the rate,
replica statuses) comes from the last status snapshot the core sent with its step message (or,
for /load and GetServerStatus, from the core when asked: refresh); `find` and `requests` are
this frontend's own requests in flight. Each step message carries every output of this
frontend's requests, delivered to their sinks here, with its text made here first where the
frontend makes it (frontends/text.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, Optional, cast

from cython_ext.step_outputs import expand_outputs
from scheduler_service.api.admission import Rejected
from scheduler_service.core.request import FinishReason, Request, RequestOutput
from scheduler_service.frontends.link import Link
from scheduler_service.frontends.text import FrontendText, made_by_frontend
from scheduler_service.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Status:
    """The core's state the doors read, sent with every step (and while idle)."""

    num_waiting: int = 0
    num_waiting_tokens: int = 0
    num_running: int = 0
    num_requests: int = 0
    capacity_tokens: int = 0
    num_usable_blocks: int = 1
    num_free_blocks: int = 1
    tokens_per_s: float = 0.0
    engine_up: bool = False
    draining: bool = False
    statuses: tuple = ()


class RemoteKV:
    """KVView over the snapshot; reset_prefix_cache is a call to the core (awaited by the
    door: ops_http accepts an awaitable answer)."""

    def __init__(self, engine: "RemoteEngine"):
        self._engine = engine

    @property
    def capacity_tokens(self) -> int:
        return self._engine.status.capacity_tokens

    @property
    def num_usable_blocks(self) -> int:
        return self._engine.status.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._engine.status.num_free_blocks

    def reset_prefix_cache(self) -> Any:
        return self._engine.call("reset_prefix_cache")


class RemoteScheduler:
    """SchedulerView: the snapshot's figures and this frontend's requests."""

    def __init__(self, engine: "RemoteEngine"):
        self._engine = engine
        self.kv = RemoteKV(engine)

    def find(self, request_id: str) -> Optional[Request]:
        return self._engine.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return self._engine.status.num_waiting

    @property
    def num_waiting_tokens(self) -> int:
        """The engine core's count, as of its last step message."""
        return self._engine.status.num_waiting_tokens

    @property
    def running(self) -> list:
        """As long as the core's running list (the doors only count it)."""
        return [None] * self._engine.status.num_running

    @property
    def requests(self) -> dict[str, Request]:
        return self._engine.requests


class _Rejections:
    """EngineMetrics as far as the doors use it: refusals are counted in the core (one set of
    metrics for every frontend); the rest is reported there by the engine loop."""

    def __init__(self, engine: "RemoteEngine"):
        self._engine = engine

    def on_rejected(self, reason: str) -> None:
        self._engine.link.send(("rejected", reason))

    def __getattr__(self, name: str):
        if name.startswith("on_") and name != "on_lora_request":
            return lambda *args: None
        raise AttributeError(name)


class RemoteEngine:
    """EngineFrontend backed by the link (scheduler_service/frontends/process.py runs it)."""

    # Admission leaves the queue's bounds to the core: it checks each add against its live
    # queue and answers an add over them with the refusal (on_refused).
    checks_room_on_add = True

    def __init__(self, link: Link, status: Status, tokenizer: Tokenizer):
        self.link = link
        self.status = status
        self.text = FrontendText(tokenizer)
        self.requests: dict[str, Request] = {}
        self._samples_left: dict[str, int] = {}
        self.scheduler = RemoteScheduler(self)
        self.metrics = _Rejections(self)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        # Requests being placed (placed()): their refusal, once the core sent one.
        self._placing: dict[str, Optional[Rejected]] = {}
        self.num_outputs = 0  # outputs delivered here (the tests see both frontends served)

    @property
    def tokens_per_s(self) -> float:
        return self.status.tokens_per_s

    def statuses(self) -> list[dict]:
        return list(self.status.statuses)

    def add_request(self, request: Request) -> None:
        if self.requests.get(request.request_id) is request:
            return  # placed already (placed())
        self.requests[request.request_id] = request
        self._samples_left[request.request_id] = request.n
        self.link.send(("add", request))

    async def placed(self, request: Request) -> None:
        """Adds `request` now and returns once the core took it; Rejected as the core refused it
        (the HTTP doors need the answer before their response starts; the gRPC doors read a
        refusal from the request's sink instead)."""
        self.add_request(request)
        self._placing[request.request_id] = None
        try:
            await self.call("barrier")  # its reply follows the add's refusal, if any, on the link
        except ConnectionError:
            pass  # the core is gone: the request's sink has its error ending (fail_all)
        finally:
            rejected = self._placing.pop(request.request_id)
        if rejected is not None:
            raise rejected

    def on_refused(self, request_id: str, rejected: Rejected) -> None:
        """The core refused an add: the request is forgotten here and its door gets `rejected`
        as admission would have raised it (placed() raises it; the gRPC doors find it in the
        request's sink, streams.outputs_of and the Session raise or send it)."""
        request = self.requests.pop(request_id, None)
        self._samples_left.pop(request_id, None)
        if request is None:
            return
        if request_id in self._placing:
            self._placing[request_id] = rejected
        else:
            # Every door's sink is a queue, which takes it beside the outputs.
            cast(Any, request.outputs).put_nowait(rejected)

    async def refresh(self) -> None:
        """The core's figures now, for the doors that report them (/load, GetServerStatus): the
        snapshot is as old as this frontend's last step message or the idle tick."""
        self.status = await self.call("status")

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self.requests:
            return False
        self.link.send(("abort", request_id))
        return True

    def abort_anywhere(self, request_id: str) -> asyncio.Future:
        """The Abort RPC: a request of any frontend (a client may abort on another connection
        than the one its stream runs on); a future of whether it was in flight."""
        if self.abort_request(request_id):
            future = asyncio.get_running_loop().create_future()
            future.set_result(True)
            return future
        return self.call("abort", request_id)

    def call(self, op: str, *args: Any) -> asyncio.Future:
        """A rare operation run by the core (reset the prefix cache, render /metrics): a future
        of its answer."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.link.send(("call", call_id, op, args))
        return future

    def on_step(self, compact: list[Any], status: Status) -> None:
        """A step message: outputs to their requests' sinks, then the new snapshot. (The outputs
        travel flat, an output of token ids alone as its ids: cython_ext/step_outputs.pyx
        compact_outputs.)"""
        self.status = status
        outputs = expand_outputs(compact, RequestOutput)
        self.num_outputs += len(outputs)
        for request_id, output in outputs:
            request = self.requests.get(request_id)
            if request is None:
                continue  # ended here already (aborted and its final delivered)
            if made_by_frontend(request):
                self.text.fill(request, output)
            request.outputs.put_nowait(output)
            if output.finish_reason is not None:
                self._samples_left[request_id] -= 1
                if not self._samples_left[request_id]:
                    del self._samples_left[request_id], self.requests[request_id]

    def on_reply(self, call_id: int, result: Any) -> None:
        future = self._calls.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def fail_all(self) -> None:
        """The core is gone: every request ends with an error, every call with none."""
        for request in list(self.requests.values()):
            for index in range(request.n):
                request.outputs.put_nowait(
                    RequestOutput(
                        token_ids=[], text="", finish_reason=FinishReason.ERROR, index=index
                    )
                )
        self.requests.clear()
        self._samples_left.clear()
        self.text.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ConnectionError("the engine core is gone"))
        self._calls.clear()

    async def stop(self) -> None:
        return None
