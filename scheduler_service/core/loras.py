"""One scheduler's LoRA state: which adapters its requests use, which its model service holds.

Counts (by adapter name; the base model, "", is never counted):

    running     sequences holding a slot    at most max_loras names: the admission rule keeps it so
    in_flight   requests waiting or running unload is refused while > 0

Residency (the scheduler decides it; the model service only obeys LoadAdapter / EvictAdapter):

    resident    name -> lora_id, least recently admitted first (an OrderedDict used as an LRU)
    wanted      names a waiting request needs loaded (the engine loop starts the loads)
    loading     names whose LoadAdapter is in flight
    forgotten   names unloaded by the operator, still resident, evicted once idle

An adapter may be evicted once no sequence of this scheduler runs with it and the plan that
released its last slot has come back (`idle_since` <= `completed_step`): with two plans in
flight the model service may still hold a finished sequence's slot until then. Among those,
adapters with no waiting request go first (least recently used first), then adapters only
waiting requests use (their requests load them again when their turn comes); an adapter a
running sequence uses is never evicted. A model-service restart empties `resident` and bumps
`epoch`, so that a load started before it does not mark the adapter resident afterwards.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from scheduler_service.core.request import Request


@dataclasses.dataclass(frozen=True)
class LoraCapacity:
    """What the model service can hold of adapters (DescribeResponse.lora)."""

    max_loras: int
    """Distinct adapters in one step."""
    max_lora_rank: int
    max_cpu_loras: int
    """Adapters loaded at once."""
    target_modules: tuple[str, ...] = ()


class LoraState:
    """The adapter counts and residency of one scheduler (one model service)."""

    def __init__(self, capacity: Optional[LoraCapacity]):
        self.capacity = capacity
        self.max_loras = capacity.max_loras if capacity is not None else 0
        self.running: collections.Counter[str] = collections.Counter()
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.resident: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.wanted: dict[str, int] = {}
        self.loading: set[str] = set()
        self.forgotten: dict[str, int] = {}
        self.idle_since: dict[str, int] = {}
        self.completed_step = 0
        self.epoch = 0
        # The no-starvation rule (core/lora_admission.py): the request skipped too long and the
        # adapter drained to make room for it.
        self.starved: Optional[Request] = None
        self.draining: Optional[str] = None
        # Rotation (core/lora_admission.py): when each running adapter took its place, the ones
        # closed to new requests until they drain, the adapters whose requests waited a quantum
        # for a place in the last step (the longest wait of each) and, with preemptive
        # rotation, the adapters a preempted adapter's place is kept for.
        self.place_since: dict[str, int] = {}
        self.closed: set[str] = set()
        self.waiting_for_place: dict[str, int] = {}
        self.promised: set[str] = set()
        # Parking (core/lora_parking.py): the adapters in turn and those waiting for one.
        self.turns = LoraTurns()

    @property
    def enabled(self) -> bool:
        return self.capacity is not None

    # ---- counts ------------------------------------------------------------------------------

    def on_start(self, name: str, step_id: int) -> None:
        """A sequence of `name` took a slot (admitted, resumed or forked) in plan `step_id`."""
        if name:
            self.running[name] += 1
            self.place_since.setdefault(name, step_id)
            self.promised.discard(name)
            self.idle_since.pop(name, None)
            if name in self.resident:
                self.resident.move_to_end(name)

    def on_stop(self, name: str, next_step_id: int) -> None:
        """A sequence of `name` left its slot; the next plan (`next_step_id`) tells the model
        service."""
        if name:
            self.running[name] -= 1
            if self.running[name] <= 0:
                del self.running[name]
                self.idle_since[name] = next_step_id
                self.place_since.pop(name, None)
                self.closed.discard(name)

    def on_arrive(self, name: str) -> None:
        if name:
            self.in_flight[name] += 1

    def on_leave(self, name: str) -> None:
        if name:
            self.in_flight[name] -= 1
            if self.in_flight[name] <= 0:
                del self.in_flight[name]

    def waiting_names(self) -> list[str]:
        """Adapters with at least one waiting request, sorted; with parking, also those whose
        running sequences are parked (they wait for their turn: core/lora_parking.py)."""
        waiting = {name for name, n in self.in_flight.items() if n > self.running.get(name, 0)}
        if self.turns.on:
            waiting.update(name for name in self.running if name not in self.turns.active)
        return sorted(waiting)

    def running_names(self) -> list[str]:
        """Adapters with running sequences, sorted; with parking, only those in turn (the
        others' sequences are parked: waiting_names)."""
        if self.turns.on:
            return sorted(name for name in self.running if name in self.turns.active)
        return sorted(self.running)

    # ---- residency ---------------------------------------------------------------------------

    def want(self, name: str, lora_id: int) -> None:
        """A waiting request needs `name` loaded here."""
        if name not in self.resident and name not in self.loading:
            self.wanted[name] = lora_id

    def is_idle(self, name: str) -> bool:
        """No sequence runs with `name` and the model service has dropped the last one."""
        if self.running.get(name, 0) > 0:
            return False
        return self.idle_since.get(name, 0) <= self.completed_step

    def victim(self) -> Optional[str]:
        """The resident adapter to evict for room: idle ones with no request in flight first,
        then idle ones only waiting requests use; least recently used first. None: every
        resident adapter runs."""
        idle = [name for name in self.resident if self.is_idle(name)]
        unused = [name for name in idle if not self.in_flight.get(name)]
        candidates = unused or idle
        return candidates[0] if candidates else None

    def needs_room(self) -> bool:
        assert self.capacity is not None
        return len(self.resident) + len(self.loading) >= self.capacity.max_cpu_loras

    def start_loads(self) -> list[tuple[str, int, Optional[tuple[str, int]]]]:
        """Moves wanted adapters to `loading`: (name, lora_id, the (name, lora_id) evicted to
        make room or None). The victim leaves `resident` at once (no new sequence uses it). A
        wanted adapter stays wanted while no room can be made."""
        started: list[tuple[str, int, Optional[tuple[str, int]]]] = []
        for name, lora_id in list(self.wanted.items()):
            evicted = None
            if self.needs_room():
                victim = self.victim()
                if victim is None:
                    break
                evicted = (victim, self.resident.pop(victim))
            del self.wanted[name]
            self.loading.add(name)
            started.append((name, lora_id, evicted))
        return started

    def loaded(self, name: str, lora_id: int, epoch: int) -> bool:
        """A load started in `epoch` is done; False when the model service restarted since
        (the adapter is not there)."""
        self.loading.discard(name)
        if epoch != self.epoch:
            return False
        self.resident[name] = lora_id
        return True

    def load_failed(self, name: str) -> None:
        self.loading.discard(name)

    def take_idle_forgotten(self) -> list[tuple[str, int]]:
        """Unloaded adapters now idle here: to evict."""
        idle = [(name, lora_id) for name, lora_id in self.forgotten.items() if self.is_idle(name)]
        for name, _ in idle:
            del self.forgotten[name]
        return idle

    def reset(self, capacity: Optional[LoraCapacity]) -> None:
        """The model service restarted (`capacity`: its Describe's): it holds no adapter; every
        running sequence was preempted (reset_engine), so nothing runs either."""
        self.capacity = capacity
        self.max_loras = capacity.max_loras if capacity is not None else 0
        self.resident.clear()
        self.wanted.clear()
        self.loading.clear()
        self.forgotten.clear()
        self.running.clear()
        self.idle_since.clear()
        self.completed_step = 0
        self.epoch += 1
        self.draining = None
        self.place_since.clear()
        self.closed.clear()
        self.waiting_for_place.clear()
        self.promised.clear()
        self.turns.clear()

    def note_waiting(self, name: str, skips: int) -> None:
        """A request of `name` waited `skips` steps (a quantum or more) for a place."""
        self.waiting_for_place[name] = max(skips, self.waiting_for_place.get(name, 0))

    def lapse_promises(self) -> None:
        """A promised place is free again once its adapter has no request left waiting (they
        were aborted, or handed to another replica)."""
        if self.promised:
            self.promised = {name for name in self.promised if self.in_flight.get(name, 0) > 0}

    def rotate(self, step_id: int, quantum: int, preempt: bool = False) -> list[str]:
        """The running adapters that give their place to adapters that waited `quantum` steps
        for one: oldest place first, held `quantum` steps, as many as those need beyond the free
        places and the closing ones (0: no rotation). Draining rotation closes them (returns
        []); preemptive rotation returns them, to preempt, and keeps the places they free for
        the adapters that waited longest (`promised`), one each."""
        waiting, self.waiting_for_place = self.waiting_for_place, {}
        waiting = {name: n for name, n in waiting.items() if self.in_flight.get(name, 0) > 0}
        self.lapse_promises()
        if not quantum or not waiting:
            return []
        wanting = set(waiting) | self.promised
        free = max(0, self.max_loras - len(self.running))
        need = len(wanting) - free - len(self.closed)
        if need <= 0:
            return []
        held = sorted(
            (since, name)
            for name, since in self.place_since.items()
            if name not in self.closed and step_id - since >= quantum
        )
        chosen = [name for _, name in held[:need]]
        if not preempt:
            self.closed.update(chosen)
            return []
        longest = sorted(set(waiting) - self.promised, key=lambda n: (-waiting[n], n))
        self.promised.update(longest[: len(chosen)])
        return chosen

    def forget(self, name: str) -> None:
        """The operator unloaded `name` (no request uses it): evicted here once idle."""
        self.wanted.pop(name, None)
        lora_id = self.resident.pop(name, None)
        if lora_id is not None:
            self.forgotten[name] = lora_id


class LoraTurns:
    """The adapters in turn (at most max_loras) and those waiting for one."""

    def __init__(self) -> None:
        self.active: dict[str, int] = {}  # name -> the step its turn began
        self.waiting_since: dict[str, int] = {}  # name -> the step it began waiting for a turn
        self.num_parked = 0  # sequences parked in the last step built (a gauge)
        self.num_parked_total = 0  # sequence-steps parked since start (a counter)
        self.on = False  # parking is the rule in force (set by each step)

    def clear(self) -> None:
        """A model-service restart: nothing runs, nothing is in turn."""
        self.active.clear()
        self.waiting_since.clear()
        self.num_parked = 0

    def begin(self, name: str, step_id: int) -> None:
        """`name` takes a place (admitted into a free one, or given a turn)."""
        self.active.setdefault(name, step_id)
        self.waiting_since.pop(name, None)

    def note_waiting(self, name: str, step_id: int) -> None:
        """`name` has work and no turn: it queues for one (its first step of waiting kept)."""
        if name not in self.active:
            self.waiting_since.setdefault(name, step_id)

    def next_turns(self, loras: LoraState, step_id: int, quantum: int) -> None:
        """At a step's start: adapters with nothing in flight give up their place; waiting
        adapters (oldest wait first) take the free places, then those of adapters that held
        theirs `quantum` steps (oldest turn first). The starved request's adapter goes first
        and may take the oldest turn however short (core/lora_admission.py: no starvation)."""
        in_flight = loras.in_flight
        for name in [n for n in self.active if not in_flight.get(n)]:
            del self.active[name]
        for name in [n for n in self.waiting_since if not in_flight.get(n)]:
            del self.waiting_since[name]
        starved = loras.starved.lora_name if loras.starved is not None else None
        if starved is not None:  # skipped for a load or for the starved rule, not "full"
            self.note_waiting(starved, step_id)
            # An adapter in turn with nothing running admits nothing while one starves.
            for name in [n for n in self.active if n != starved and not loras.running.get(n)]:
                del self.active[name]
        queue = sorted(
            (name for name in self.waiting_since if name in loras.resident),
            key=lambda n: (n != starved, self.waiting_since[n], n),
        )
        for name in queue:
            if len(self.active) >= loras.max_loras:
                held = [n for n, since in self.active.items() if step_id - since >= quantum]
                if not held and name == starved:
                    held = list(self.active)
                if not held:
                    break
                ended = min(held, key=lambda n: (self.active[n], n))
                del self.active[ended]
                self.waiting_since[ended] = step_id  # behind every adapter already waiting
            self.begin(name, step_id)
