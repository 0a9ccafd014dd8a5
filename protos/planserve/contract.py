"""The contract facts both services hold alike, owned here once: the scheduler service and the
model service both import the planserve package (and neither imports the other).

CONTRACT_VERSION is engine.proto's: Describe reports it and the scheduler refuses an engine that
speaks another. It changes only on a breaking change of the wire; additive fields keep it (buf
breaking guards that, tests/contract).

REQUEST_BOUNDS are the sampling bounds: the model service checks every plan against them and
reports them in Describe (max_top_logprobs, request_bounds); the scheduler's doors check each
request against what the engine reported, so a request out of bounds is refused, naming the field,
before it is queued.

CPU_STEP is the step shape of the CPU: the model service's choice on a CPU and the scheduler's
for an engine that reports none (DescribeResponse.step_token_budget / step_max_seqs 0).

The link's keepalive: each end pings the other every `interval_s` while connected, and a ping
unanswered within `interval_s` closes the connection. A peer gone without closing its socket (its
host lost, a network partition) then ends the model service's Execute stream, whose slots are
dropped so that the next scheduler may connect, and the scheduler's channel, which reconnects
(resolving the address again), instead of each waiting for TCP to give up (about 15 minutes on
Linux's defaults). Each end takes the other's pings however often they come, so the two
intervals need not match.
"""

from __future__ import annotations

import dataclasses

CONTRACT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RequestBounds:
    """Bounds of a request's sampling fields (engine.proto RequestBounds, plus
    DescribeResponse.max_top_logprobs), inclusive unless noted."""

    max_top_logprobs: int = 20
    """Alternatives per position returned with logprobs (and prompt logprobs)."""
    max_logit_bias_entries: int = 300
    """logit_bias entries in one request."""
    max_logit_bias: float = 100.0
    """|logit_bias[token id]| at most this."""
    max_repetition_penalty: float = 2.0
    """repetition_penalty in (0, this]."""
    max_penalty: float = 2.0
    """|presence_penalty| and |frequency_penalty| at most this (OpenAI's bound)."""


REQUEST_BOUNDS = RequestBounds()


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The largest step: what the model service profiles before sizing its KV cache, reports in
    Describe (step_token_budget, step_max_seqs), and the scheduler plans by unless its own flags
    say otherwise."""

    token_budget: int
    """Most tokens of one step (decodes take 1 each, prompt chunks the rest): the scheduler's
    max_num_batched_tokens."""
    max_seqs: int
    """Most sequences of one step: the scheduler's max_num_seqs."""


# Sized for a 2-core CPU, where a step's forward grows with its tokens and latency matters more
# than a larger batch's throughput.
CPU_STEP = StepShape(token_budget=512, max_seqs=64)


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """gRPC options of either end of the link (the model service's server, the scheduler's
    channels): ping every `interval_s`, with or without a call open and with or without data
    sent since the last ping; close the connection on a ping unanswered for as long; take the
    peer's pings without limit."""
    interval_ms = max(1, round(interval_s * 1000))
    return [
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", interval_ms),
        # gRPC 1.85's transport times a ping out by this one; keepalive_timeout_ms alone
        # leaves an unanswered ping waiting.
        ("grpc.http2.ping_timeout_ms", interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.max_ping_strikes", 0),
    ]
