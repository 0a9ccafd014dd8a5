"""The public API's bad input: each request must get INVALID_ARGUMENT naming the field
(`planserve conformance --api --check bad_input`)."""

from __future__ import annotations

import re
from typing import Callable

import grpc

from tools.conformance.api_context import ApiContext
from tools.conformance.report import Check, CheckFailed, expect

BAD_INPUT_CHECKS: list[Check] = []


# -- bad input: INVALID_ARGUMENT naming the field -------------------------------------------------


def _bad_input(name: str, field: str):
    def register(edit: Callable) -> Callable:
        async def run(ctx: ApiContext) -> str:
            request = await ctx.greedy(4)
            await edit(ctx, request)
            try:
                await ctx.complete(request)
            except grpc.aio.AioRpcError as error:
                expect(
                    error.code() == grpc.StatusCode.INVALID_ARGUMENT,
                    f"ended with {error.code().name}: {error.details()}",
                )
                expect(
                    re.search(rf"(?<!\w){re.escape(field)}(?!\w)", error.details() or ""),
                    f"INVALID_ARGUMENT {error.details()!r} does not name {field}",
                )
                return f"{error.details()!r}"
            raise CheckFailed("the request was served")

        BAD_INPUT_CHECKS.append(
            Check(f"bad_input.{name}", f"{field} -> INVALID_ARGUMENT naming it", run)
        )
        return edit

    return register


@_bad_input("no_prompt", "prompt")
async def _(ctx, r):
    r.ClearField("token_ids")


@_bad_input("empty_token_ids", "token_ids")
async def _(ctx, r):
    del r.token_ids.ids[:]


@_bad_input("token_outside_vocab", "token_ids")
async def _(ctx, r):
    r.token_ids.ids.append((await ctx.info()).vocab_size)


@_bad_input("prompt_too_long", "prompt")
async def _(ctx, r):
    r.token_ids.ids.extend([1] * (await ctx.info()).max_model_len)


@_bad_input("max_new_tokens_zero", "stopping.max_new_tokens")
async def _(ctx, r):
    r.stopping.max_new_tokens = 0


@_bad_input("negative_temperature", "sampling.temperature")
async def _(ctx, r):
    r.sampling.temperature = -1.0


@_bad_input("top_p_above_one", "sampling.top_p")
async def _(ctx, r):
    r.sampling.top_p = 1.5


@_bad_input("top_k_zero", "sampling.top_k")
async def _(ctx, r):
    r.sampling.top_k = 0


@_bad_input("stop_token_outside_vocab", "stopping.stop_token_ids")
async def _(ctx, r):
    r.stopping.stop_token_ids.append((await ctx.info()).vocab_size)


@_bad_input("zero_deadline", "deadline_ms")
async def _(ctx, r):
    r.deadline_ms = 0


@_bad_input("too_many_samples", "n")
async def _(ctx, r):
    r.n = 1000
