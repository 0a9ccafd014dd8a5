"""Adapter-aware admission: at most max_loras distinct LoRA adapters in a step, skipping (never
blocking) and never starving.

The rule, applied to each waiting request in the policy's order (any policy), before its budget
and blocks are looked at:

  * a base-model request (no adapter) takes no place: never held back here;
  * a request whose adapter already runs takes no new place: admitted as usual;
  * a request whose adapter would make max_loras + 1 distinct running adapters is skipped;
  * a request whose adapter is not loaded in this model service is skipped and the adapter is
    asked for (the engine loop loads it, evicting an idle one beyond max_cpu_loras). Only with
    a place free, so that adapters that could not run anyway are not loaded and evicted in turn.

A skipped request goes back to its place in the queue once the step is built (`put_back`), so
the requests behind it are admitted in this step and it comes first again in the next one. The
running adapters never exceed max_loras, so neither does any plan. The chunked-prefill budget
is untouched: a skipped request takes none of it.

No starvation. Under a steady stream of requests for max_loras popular adapters a rare one would
wait forever: each popular adapter always has a request running, so no place frees. Every skip
counts on the request (`Request.lora_skips`); once one has been skipped `lora_max_skipped_steps`
times it is the *starved* request (one at a time, the first reached) and until it is admitted:

  * no request of an adapter that is not running may take a new place, unless it is the starved
    request's adapter (a place that frees is kept for it, and only its adapter is loaded);
  * one running adapter is *drained*: the one with the fewest running sequences when the places
    are full (or when every loaded adapter runs and none can be evicted for the starved one); its
    new requests are skipped, so its running ones finish and its place frees.

Requests of the other running adapters and of the base model are admitted as before, so the
drain costs at most one adapter's admissions for as long as its running requests take.

Rotation (latency, not only liveness). An adapter that keeps receiving requests never drains on
its own, so without more the places go round only at the starvation bound's pace, and with more
adapters than places the waiting time grows into a cliff. So a place is held for a quantum:
once requests have waited `lora_rotate_after_steps` steps for a place, as many running adapters
as they need (beyond the free places and those already closing), the ones that took their place
longest ago and held it for a quantum, are *closed*: they admit nothing new until their running
sequences finish and the place frees; the waiting adapter then admits its whole backlog at once.
Each place thus serves adapters in turns of about a quantum plus one request's lifetime.

Parking (`lora_park_after_steps`, the default; core/lora_parking.py) replaces draining
rotation: the places are counted over the adapters *in turn* (`_blocked_by_turn`), sequences of
the others sit steps out keeping their KV, and the turns go round every quantum.

Preemptive rotation (`lora_preempt_after_steps`, replacing the above when set): the chosen
adapters are preempted instead of closed, before the step's running sequences are scheduled
(`_lora_preempt`), so a turn is a quantum and no longer includes a request's lifetime. Each
place a preemption frees is promised to the adapter that waited longest: the preempted requests
go back ahead of fresh ones and would otherwise take it straight back.
"""

from __future__ import annotations

from typing import Optional

from scheduler_service.core.lora_parking import LoraParking
from scheduler_service.core.loras import LoraState
from scheduler_service.core.plan import StepPlan
from scheduler_service.core.request import Request, RequestStatus

# At most this many requests are skipped (popped and put back) per step: past it admission
# stops, as without adapters, rather than scan a long queue every step.
MAX_SKIPS_PER_STEP = 256


def lora_blocked(loras: LoraState, request: Request) -> Optional[str]:
    """Why `request` cannot start this step for its adapter (None: it can). "load": its adapter
    is not loaded here; "full": max_loras adapters run (with parking: are in turn); "starved": a
    place is kept for the starved request's adapter; "draining": its adapter is being drained
    for the starved request; "closed": its adapter held its place a quantum while others
    waited, and drains."""
    name = request.lora_name
    if not name:
        return None
    starved = loras.starved
    if loras.turns.on:
        return _blocked_by_turn(loras, request)
    if name in loras.running:
        if name in loras.closed:
            return "closed"
        if starved is not None and name == loras.draining and request is not starved:
            return "draining"
        return None
    if starved is not None and starved.lora_name != name:
        return "starved"
    if name not in loras.resident:
        return "load"
    # Places a preemption freed are kept for the adapters they were promised to (the starved
    # request's adapter excepted: it already holds every other adapter back).
    kept = 0 if starved is not None else len(loras.promised) - (name in loras.promised)
    if len(loras.running) + kept >= loras.max_loras:
        return "full"
    return None


def _blocked_by_turn(loras: LoraState, request: Request) -> Optional[str]:
    """lora_blocked with parking (core/lora_parking.py): an adapter in turn admits; another
    takes a free place, if any. While a request starves, an adapter in turn with nothing
    running admits nothing either (as a place that frees: kept for the starved one)."""
    name, starved = request.lora_name, loras.starved
    kept = starved is not None and name != starved.lora_name and name not in loras.running
    if name in loras.turns.active and not kept:
        if name not in loras.resident:  # evicted while only waiting requests held its turn
            return "load"
        if starved is not None and name == loras.draining and request is not starved:
            return "draining"
        return None
    if starved is not None and starved.lora_name != name:
        return "starved"
    if name not in loras.resident:
        return "load"
    if len(loras.turns.active) >= loras.max_loras:
        return "full"
    return None


class LoraAdmission(LoraParking):
    """The adapter rule of step 2 (a part of Scheduler; parking's turns before step 1)."""

    loras: LoraState
    num_lora_rotations_total = 0  # adapters preempted by preemptive rotation (per instance)

    def _lora_skip(self, request: Request) -> bool:
        """True when `request` must be skipped this step for its adapter (counted, and its
        adapter asked for when it is not loaded)."""
        loras = self.loras
        why = lora_blocked(loras, request)
        if why is None:
            return False
        if why == "load":
            loras.want(request.lora_name, request.lora_id)
        request.lora_skips += 1
        config = self.config
        quantum = config.lora_preempt_after_steps or config.lora_rotate_after_steps
        if why == "full" and loras.turns.on:
            loras.turns.note_waiting(request.lora_name, self._next_step_id - 1)
        elif why == "full" and quantum and request.lora_skips >= quantum:
            loras.note_waiting(request.lora_name, request.lora_skips)
        if loras.starved is None and request.lora_skips >= self.config.lora_max_skipped_steps:
            loras.starved = request
            self._choose_drained()
        return True

    def _lora_step_start(self) -> None:
        """Before a step's admissions: the starved request is forgotten once it is admitted or
        gone, and a drained adapter chosen while it still waits."""
        loras = self.loras
        if not (self.config.lora_preempt_after_steps or loras.turns.on):  # rotated already
            loras.rotate(self._next_step_id, self.config.lora_rotate_after_steps)
        loras.lapse_promises()
        starved = loras.starved
        if starved is None:
            return
        if starved.status is not RequestStatus.WAITING or starved.request_id not in self.requests:
            loras.starved = None
            loras.draining = None
            return
        if loras.draining not in loras.running:
            self._choose_drained()

    def _lora_preempt(self, plan: StepPlan) -> None:
        """Preemptive rotation, before the step's running sequences are scheduled: every
        sequence of each adapter `LoraState.rotate` chooses is preempted (swap or recompute, as
        for want of blocks; requeued ahead of fresh requests, last first so their order holds),
        and its place is kept for the adapter that waited longest."""
        quantum = self.config.lora_preempt_after_steps
        if not quantum or not self.loras.waiting_for_place:
            return
        chosen = set(self.loras.rotate(self._next_step_id, quantum, preempt=True))
        for request in reversed([r for r in self.running if r.lora_name in chosen]):
            self._preempt(request, plan)
        self.num_lora_rotations_total += len(chosen)

    def _choose_drained(self) -> None:
        """The running adapter with the fewest running sequences, when the starved request
        needs one of them to make room (places full, or no loaded adapter can be evicted)."""
        loras = self.loras
        loras.draining = None
        starved = loras.starved
        if starved is None or not loras.running:
            return
        name = starved.lora_name
        # With parking a full set of places is no reason: the turns come round by themselves.
        places_full = len(loras.running) >= loras.max_loras and not loras.turns.on
        no_room = (
            name not in loras.resident
            and loras.capacity is not None
            and loras.needs_room()
            and loras.victim() is None
        )
        if places_full or no_room:
            loras.draining = min(loras.running, key=lambda n: (loras.running[n], n))

    def _lora_admitted(self, request: Request) -> None:
        """`request` took a slot: its adapter counts as running."""
        loras = self.loras
        loras.on_start(request.lora_name, self._next_step_id)
        if loras.turns.on:
            loras.turns.begin(request.lora_name, self._next_step_id - 1)
        request.lora_skips = 0  # counts one wait: a preempted request's next starts from 0
        if request is loras.starved:
            loras.starved = None
            loras.draining = None
