"""Several model-service replicas behind one scheduler: a layer above the single-engine scheduler.

Each replica is the unchanged single-engine stack (its own EngineClient, its own Scheduler with
the block pool its own Describe sized, its own EngineLoop with crash recovery); this module adds
only what sits above them:

    new request --> Router (weighted scorers) --> replica k: Scheduler + EngineLoop --> engine k

- Routing happens once, at admission; a request then lives on its replica (its KV is there).
- A replica whose engine goes down (its loop says so, having preempted every sequence back to
  waiting) is drained: its requests move to the replicas that are up, with the tokens already
  streamed, and are recomputed there like any preempted request: no request is lost and no token
  is sent twice. With no replica up they stay and wait for the first one back.
- Engines: a list ("h1:p1,h2:p2", `--engine` repeated) or `dns:///name:port`, a Kubernetes
  headless Service resolved to one replica per address and re-resolved every
  `replica_check_interval_s`: a new address joins, a vanished one is drained and dropped.
- `ReplicaSet` is an EngineFrontend (engine/frontend.py) as an EngineLoop is, so the doors do
  not tell them apart; `ReplicaSet.scheduler` merges the replicas' loads.
- Status and metrics per replica: `statuses()` (GetServerStatus.replicas) and Prometheus series
  labelled `replica` (up, waiting, running, KV usage, routed, drained, prompt and cached tokens).

Moving a request between schedulers goes through their public hand_off / take_over (the
queue, the request table, parallel-sample groups; the detokenizer stays in the shared
OutputProcessor).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Optional

import structlog

from scheduler_service.config import SchedulerConfig
from scheduler_service.core.lora_registry import LoraRegistry
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine import client as engine_client
from scheduler_service.engine.addresses import (
    DNS_PREFIX,
    resolve_dns,
    split_addresses,
)
from scheduler_service.engine.client import EngineClient, EngineFacts
from scheduler_service.engine.kv_events import KVEventPublisher, KVEventStream
from scheduler_service.engine.loop import EngineLoop
from scheduler_service.engine.merged import MergedScheduler, ReplicaMetrics
from scheduler_service.engine.replica_series import ReplicaSeries
from scheduler_service.engine.router import Router
from scheduler_service.metrics import Metrics
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("planserve.replicas")


@dataclasses.dataclass(eq=False)
class Replica:
    name: str  # the engine address, as configured or resolved
    client: EngineClient
    loop: EngineLoop

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler

    @property
    def up(self) -> bool:
        return self.loop.engine_up


def move_waiting_request(request: Request, src: Scheduler, dst: Scheduler) -> None:
    """Hand a waiting request (holding no slot and no block: fresh, or preempted by the engine
    loop's reset) from one replica's scheduler to another's. Its streamed tokens go with it, so it
    is recomputed there from prompt + output like a preempted request; its detokenizer (shared
    OutputProcessor) is kept, so the text continues where the client's stream is."""
    dst.take_over(request, src.hand_off(request))


class ReplicaSet:
    """Stands where the servicer expects an EngineLoop; owns one EngineLoop per replica."""

    def __init__(
        self,
        config: SchedulerConfig,
        metrics: Metrics,
        make_client: Callable[[str], EngineClient] = EngineClient,
        on_serving: Callable[[bool], None] = lambda up: None,
        kv_publisher: Optional[KVEventPublisher] = None,
        lora_registry: Optional[LoraRegistry] = None,
    ):
        self.config = config
        self.lora_registry = lora_registry or LoraRegistry()  # one id per adapter, every replica
        self.kv_publisher = kv_publisher  # KV-cache events: one socket, a rank per replica
        self._ranks: dict[str, int] = {}  # by address, in the order replicas first connect
        self.metrics = metrics
        self.router = Router.from_spec(config.router_weights)
        self.replicas: list[Replica] = []
        self.scheduler = MergedScheduler(
            lambda: [r.scheduler for r in self.replicas], lambda: self.facts
        )
        self.facts: Optional[EngineFacts] = None
        self.tokenizer: Optional[Tokenizer] = None
        self.outputs: Optional[OutputProcessor] = None
        self._make_client = make_client
        self._on_serving = on_serving
        self._connecting: set[str] = set()
        self._maintainer: Optional[asyncio.Task] = None
        self._serving = False
        self.series = ReplicaSeries.register(metrics.registry)  # labelled `replica`

    # ---- what the doors call (EngineFrontend) --------------------------------------------

    @property
    def tokens_per_s(self) -> float:
        return sum(getattr(r.loop, "tokens_per_s", 0.0) for r in self.replicas)

    def add_request(self, request: Request) -> None:
        candidates = [r for r in self.replicas if r.up] or self.replicas
        replica = candidates[self.router.choose(request, candidates)]
        replica.loop.add_request(request)
        self.series.routed.labels(replica.name).inc()

    def abort_request(self, request_id: str) -> bool:
        found = False
        for replica in self.replicas:
            found = replica.loop.abort_request(request_id) or found
        return found

    def statuses(self) -> list[dict]:
        """One entry per replica, the fields of generate.proto ReplicaStatus."""
        out = []
        for replica in self.replicas:
            kv = replica.scheduler.kv
            usable, free = kv.num_usable_blocks, kv.num_free_blocks
            out.append(
                dict(
                    address=replica.name,
                    serving=replica.up,
                    num_waiting=replica.scheduler.num_waiting,
                    num_running=len(replica.scheduler.running),
                    num_kv_blocks=usable,
                    num_free_kv_blocks=free,
                    kv_cache_usage=(usable - free) / usable if usable else 0.0,
                )
            )
        return out

    # ---- life cycle ------------------------------------------------------------------------

    async def connect(self) -> tuple[EngineFacts, Tokenizer]:
        """Connects every replica the address names; returns once all did, or once one serves
        and replica_check_interval_s passed (the others join when they come up), with the first
        replica's facts and the tokenizer they share. RuntimeError when none serves within the
        connect timeout."""
        addresses = await self._wanted_addresses()
        tasks = {asyncio.ensure_future(self._add(address)) for address in addresses}
        deadline = asyncio.get_running_loop().time() + self.config.engine_connect_timeout_s
        while not self.replicas:
            timeout = deadline - asyncio.get_running_loop().time()
            if not tasks or timeout <= 0:
                if self.config.engine_address.startswith(DNS_PREFIX) and timeout > 0:
                    await asyncio.sleep(min(1.0, timeout))  # no pod yet: resolve again
                    tasks = {
                        asyncio.ensure_future(self._add(a)) for a in await self._wanted_addresses()
                    }
                    continue
                raise RuntimeError(
                    f"engine_address: no replica of {self.config.engine_address!r} answered"
                )
            done, tasks = await asyncio.wait(
                tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        if tasks:
            # One serves; give the others a short while to join (they keep trying after it).
            await asyncio.wait(tasks, timeout=self.config.replica_check_interval_s)
        self._maintainer = asyncio.get_running_loop().create_task(self._maintain(), name="replicas")
        if self.facts is None or self.tokenizer is None:  # a replica joined: both were made
            raise RuntimeError("replicas joined without the first one's facts")
        return self.facts, self.tokenizer

    async def stop(self) -> None:
        if self._maintainer is not None:
            self._maintainer.cancel()
            try:
                await self._maintainer
            except asyncio.CancelledError:
                pass
        for replica in list(self.replicas):
            await replica.loop.stop()
            await replica.client.close()

    async def _wanted_addresses(self) -> list[str]:
        if self.config.engine_address.startswith(DNS_PREFIX):
            return await resolve_dns(self.config.engine_address)
        return split_addresses(self.config.engine_address)

    async def _add(self, address: str) -> None:
        """Describe, check against the first replica's facts, probe, start its loop."""
        if address in self._connecting or any(r.name == address for r in self.replicas):
            return
        self._connecting.add(address)
        client = self._make_client(address)
        try:
            facts = await client.describe(self.config.engine_connect_timeout_s)
            first, outputs = self._join(address, facts)
            scheduler = Scheduler(self.config, facts, outputs)
            await client.probe(scheduler.take_step_ids(2), facts)
        except Exception as error:  # noqa: BLE001 - unreachable, timed out, incompatible: retried
            log.warning("replica_connect_failed", replica=address, error=repr(error))
            await client.close()
            return
        finally:
            self._connecting.discard(address)
        replica: Replica  # the loop's callback reads it once the loop runs
        loop = EngineLoop(
            scheduler,
            client,
            ReplicaMetrics(self.series, address, self.metrics, self.scheduler),
            on_engine_up=lambda up: self._on_engine_up(replica, up),
            is_compatible=lambda new: engine_client.incompatibility(first, new),
            kv_events=self._kv_event_stream(address, scheduler),
            lora_registry=self.lora_registry,
        )
        replica = Replica(address, client, loop)
        self.replicas.append(replica)
        loop.start()
        self.series.up.labels(address).set(1)
        log.info(
            "replica_up",
            replica=address,
            num_kv_blocks=facts.num_kv_blocks,
            num_replicas=len(self.replicas),
            # Each replica plans by its own engine's step shape, as by its own KV capacity.
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.token_budget,
        )
        self._update_serving()

    def _kv_event_stream(self, address: str, scheduler: Scheduler) -> Optional[KVEventStream]:
        if self.kv_publisher is None:
            return None
        rank = self._ranks.setdefault(address, len(self._ranks))
        scheduler.kv.enable_events()
        return KVEventStream(self.kv_publisher, scheduler.kv.block_size, rank)

    def _join(self, address: str, facts: EngineFacts) -> tuple[EngineFacts, OutputProcessor]:
        """The first replica's facts and the OutputProcessor every replica shares, both made
        from the first replica to connect; RuntimeError for one not like it."""
        if self.facts is None or self.outputs is None:
            self.facts = facts
            self.tokenizer = Tokenizer(
                facts.tokenizer_json, facts.chat_template, facts.special_tokens
            )
            self.outputs = OutputProcessor(self.tokenizer, facts.eos_token_ids, facts.max_model_len)
            return facts, self.outputs
        why = engine_client.incompatibility(self.facts, facts)
        if why is not None:
            raise RuntimeError(f"replica {address} is not like the others: {why}")
        return self.facts, self.outputs

    async def _remove(self, replica: Replica) -> None:
        """A replica that left (its address no longer resolves): stop it, move its requests.
        Kept while no other replica serves: its requests would have nowhere to go."""
        if not any(r.up for r in self.replicas if r is not replica):
            return
        await replica.loop.stop()
        replica.scheduler.reset_engine(replica.scheduler.facts)  # every sequence back to waiting
        if replica.loop.kv_events is not None:
            replica.loop.kv_events.clear()
        self.replicas.remove(replica)
        # Up replicas first; if they all went down during the stop, any other one (the
        # maintenance pass moves requests off a down replica once one is up).
        self._drain(
            replica, force=True, targets=[r for r in self.replicas if r.up] or list(self.replicas)
        )
        await replica.client.close()
        self.series.up.remove(replica.name)
        log.info("replica_removed", replica=replica.name, num_replicas=len(self.replicas))
        self._update_serving()

    def _on_engine_up(self, replica: Replica, up: bool) -> None:
        self.series.up.labels(replica.name).set(1 if up else 0)
        if not up:
            # The loop resets its scheduler (every sequence back to waiting) right after this
            # call, before its first await: drain once that happened.
            asyncio.get_running_loop().call_soon(self._drain, replica)
        self._update_serving()

    def _update_serving(self) -> None:
        serving = any(r.up for r in self.replicas)
        gauge = getattr(self.metrics, "engine_up", None)
        if gauge is not None:
            gauge.set(1 if serving else 0)
        if serving != self._serving:
            self._serving = serving
            self._on_serving(serving)

    def _drain(
        self, replica: Replica, force: bool = False, targets: Optional[list[Replica]] = None
    ) -> None:
        """Move every request of a replica whose engine is down to the replicas that are up."""
        if replica.up and not force:
            return  # it came back meanwhile
        if targets is None:
            targets = [r for r in self.replicas if r.up and r is not replica]
        src = replica.scheduler
        if not targets or not src.requests:
            return
        groups: dict[str, list[Request]] = {}
        for request in list(src.requests.values()):
            if request.status is RequestStatus.WAITING and request.slot is None:
                groups.setdefault(request.public_id, []).append(request)
        moved = 0
        for members in groups.values():
            dst = targets[self.router.choose(members[0], targets)]
            for request in members:
                move_waiting_request(request, src, dst.scheduler)
                moved += 1
            dst.loop.wake()  # it may be sleeping with no work
        self.series.drained.labels(replica.name).inc(moved)
        for touched in (replica, *targets):
            self._refresh_gauges(touched)  # its loop updates them only when it steps
        log.warning(
            "replica_drained", replica=replica.name, num_moved=moved, to=[t.name for t in targets]
        )

    def _refresh_gauges(self, replica: Replica) -> None:
        scheduler = replica.scheduler
        usable = scheduler.kv.num_usable_blocks
        self.series.waiting.labels(replica.name).set(scheduler.num_waiting)
        self.series.running.labels(replica.name).set(len(scheduler.running))
        self.series.kv_usage.labels(replica.name).set(
            (usable - scheduler.kv.num_free_blocks) / usable if usable else 0.0
        )

    async def _maintain(self) -> None:
        """Every replica_check_interval_s: re-resolve and reconcile the set; drain replicas that
        are down and still hold requests (say, none was up when they went down)."""
        while True:
            await asyncio.sleep(self.config.replica_check_interval_s)
            try:
                wanted = set(await self._wanted_addresses())
                for address in wanted:
                    if address not in self._connecting and not any(
                        r.name == address for r in self.replicas
                    ):
                        asyncio.ensure_future(self._add(address))
                if self.config.engine_address.startswith(DNS_PREFIX) and wanted:
                    for replica in [r for r in self.replicas if r.name not in wanted]:
                        await self._remove(replica)
                for replica in self.replicas:
                    if not replica.up and replica.scheduler.requests:
                        self._drain(replica)
            except Exception:  # noqa: BLE001 - keep maintaining
                log.exception("replica_maintenance_failed")
