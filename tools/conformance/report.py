"""Checks, their outcomes and the report. A check is an async function of a suite's context
with a name and a one-line description; it returns a short note (PASS), raises `CheckFailed`
(FAIL, with the reason) or `Skipped` (SKIP: the server does not claim the feature). Any other
exception, a timeout included, is a FAIL whose reason names the exception."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable, Optional

import grpc

CheckFn = Callable[[Any], Awaitable[Optional[str]]]


class CheckFailed(AssertionError):
    """The server did something the contract does not allow; the message says what."""


class Skipped(Exception):
    """The check does not apply to this server (e.g. a feature it does not report)."""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    description: str
    run: CheckFn


@dataclasses.dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str
    seconds: float


def check(registry: list[Check], name: str, description: str) -> Callable[[CheckFn], CheckFn]:
    """Decorator: appends the function to a suite's ordered list of checks."""

    def register(fn: CheckFn) -> CheckFn:
        registry.append(Check(name, description, fn))
        return fn

    return register


def expect(condition: bool, reason: str) -> None:
    if not condition:
        raise CheckFailed(reason)


def describe_error(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}"


async def run_checks(
    checks: list[Check], context: Any, timeout_s: float, only: Optional[set[str]] = None
) -> list[Outcome]:
    """Runs the checks in order, each bounded by timeout_s; one failure does not stop the rest."""
    outcomes = []
    for item in checks:
        if only and not any(item.name == o or item.name.startswith(o + ".") for o in only):
            continue
        started = time.perf_counter()
        try:
            note = await asyncio.wait_for(item.run(context), timeout_s)
            status, detail = "PASS", note or ""
        except Skipped as skip:
            status, detail = "SKIP", str(skip)
        except CheckFailed as failure:
            status, detail = "FAIL", str(failure)
        except asyncio.TimeoutError:
            status, detail = "FAIL", f"no answer within {timeout_s:g} s"
        except Exception as error:  # a crash of the check is the server's failure to conform
            status, detail = "FAIL", describe_error(error)
        outcomes.append(Outcome(item.name, status, detail, time.perf_counter() - started))
    return outcomes


def format_report(title: str, checks: list[Check], outcomes: list[Outcome]) -> str:
    """One line per check (status, name, what it checks; the reason or note indented below),
    then the totals."""
    described = {c.name: c.description for c in checks}
    width = max((len(o.name) for o in outcomes), default=0)
    lines = [title, ""]
    for o in outcomes:
        lines.append(f"{o.status}  {o.name:<{width}}  {described[o.name]}")
        if o.detail:
            lines.append(f"      {' ' * width}  -> {o.detail}")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "SKIP")}
    lines += [
        "",
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
        f" of {len(outcomes)} checks",
    ]
    if counts["FAIL"]:
        lines.append("failed: " + ", ".join(o.name for o in outcomes if o.status == "FAIL"))
    return "\n".join(lines)


def passed(outcomes: list[Outcome]) -> bool:
    return bool(outcomes) and all(o.status != "FAIL" for o in outcomes)
