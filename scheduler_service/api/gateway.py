"""What the Gateway API Inference Extension (and llm-d) send with a request, onto the public
request: its headers, trusted only with --trust-gateway-headers, and vLLM's body extras.

    x-gateway-inference-fairness-id  -> tenant (fair policy, prefix-cache scope `tenant`)
    x-gateway-inference-objective    -> priority, by gateway_objective_priorities
    x-slo-ttft-ms                    -> ttft_target_ms: the waiting order within a priority
                                        (policies/_heap.waiting_order); it never ends a request
    body `priority` (vLLM's: lower is handled first) -> priority = -value (planserve's: higher
                                        is more urgent); a trusted objective wins over it
    body `cache_salt`                -> cache_salt
    X-Request-Id                     -> the request id (echoed on the response by http_server)

A bad value is 400 naming the header or the field and the bound.

x-slo-tpot-ms is not read: a running sequence decodes a token every step whatever its target,
so there is no order for it to change here; the gateway uses it to pick a pod.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

from planserve.v1 import generate_pb2
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.config import INT32

FAIRNESS_ID = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"
REQUEST_ID = "x-request-id"
TTFT_TARGET = "x-slo-ttft-ms"
# ttft_target_ms is a uint32 of milliseconds.
MAX_TTFT_TARGET_MS = (1 << 32) - 1


def _priority_from_body(priority: Optional[int]) -> Optional[int]:
    if priority is None:
        return None
    if isinstance(priority, bool) or not INT32[0] + 1 <= priority <= INT32[1]:
        raise ApiError(
            400,
            f"priority: must be an integer in [{INT32[0] + 1}, {INT32[1]}], got {priority!r}",
            param="priority",
        )
    return -priority


def apply(
    pb: generate_pb2.GenerateRequest,
    priority: Optional[int],
    cache_salt: Optional[str],
    headers: Mapping[str, str],
    trusted: Optional[dict[str, int]],
) -> None:
    """Sets tenant, priority, cache_salt and ttft_target_ms of `pb` from the body's extras and,
    when `trusted` (the objective map; None: the gateway's headers are not trusted), the
    gateway's headers.
    Lengths are bounded by admission (intake), which names the field."""
    body_priority = _priority_from_body(priority)
    if body_priority is not None:
        pb.priority = body_priority
    if cache_salt is not None:
        pb.cache_salt = cache_salt
    if trusted is None:
        return
    tenant = headers.get(FAIRNESS_ID)
    if tenant is not None:
        if not tenant:
            raise ApiError(400, f"{FAIRNESS_ID}: must not be empty", param=FAIRNESS_ID)
        pb.tenant = tenant
    objective = headers.get(OBJECTIVE)
    if objective is not None:
        if objective not in trusted:
            known = ", ".join(sorted(trusted)) or "none configured"
            raise ApiError(
                400,
                f"{OBJECTIVE}: {objective!r} is not a configured objective "
                f"(gateway_objective_priorities: {known})",
                param=OBJECTIVE,
            )
        pb.priority = trusted[objective]
    target = headers.get(TTFT_TARGET)
    if target is not None:
        pb.ttft_target_ms = _ttft_target_ms(target)


def _ttft_target_ms(text: str) -> int:
    """A number of milliseconds, as llm-d sends it (an integer or a decimal), rounded up to a
    whole millisecond."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TTFT_TARGET_MS:  # also refuses nan and inf
        raise ApiError(
            400,
            f"{TTFT_TARGET}: must be a number of milliseconds in (0, {MAX_TTFT_TARGET_MS}], "
            f"got {text!r}",
            param=TTFT_TARGET,
        )
    return math.ceil(value)


def request_id(headers: Mapping[str, str], default: str) -> str:
    """The client's X-Request-Id when it sent one (admission bounds its length), else default."""
    return headers.get(REQUEST_ID) or default
