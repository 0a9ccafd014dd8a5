"""JsonBodyRoute (scheduler_service/api/json_route.py), served by a real uvicorn on 127.0.0.1
beside the same endpoint on FastAPI's own route: every body, valid or not, JSON or not, gets
the same status, headers and answer from both; a valid JSON body reaches the endpoint without
FastAPI's dependency solving, anything else through it; an endpoint that does not take (body,
request) is refused when the route is made."""

import json
from typing import Optional

import fastapi.routing
import httpx
import pytest
from asgi_served import served
from fastapi import FastAPI, HTTPException
from fastapi import Request as HttpRequest
from pydantic import BaseModel, field_validator

from scheduler_service.api.json_route import post_json
from scheduler_service.api.openai_requests import ChatCompletionRequest, CompletionRequest


class _Order(BaseModel):
    name: str
    count: int = 1
    ratio: Optional[float] = None
    tags: list[str] = []

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        if name == "nobody":
            raise ValueError("must name somebody")
        return name


async def _order(body: _Order, http: HttpRequest):
    if body.name == "conflict":
        raise HTTPException(409, "taken")
    # A tuple and a float, as jsonable_encoder turns them; the request's header as read.
    return {"order": body, "pair": (body.count, body.ratio), "agent": http.headers.get("x-agent")}


async def _completion(body: CompletionRequest, http: HttpRequest):
    return body.model_dump()


async def _chat(body: ChatCompletionRequest, http: HttpRequest):
    return body.model_dump()


ROUTES = {"/order": _order, "/v1/completions": _completion, "/v1/chat/completions": _chat}


def _app(fast: bool) -> FastAPI:
    app = FastAPI()
    for path, endpoint in ROUTES.items():
        if fast:
            post_json(app, path, endpoint)
        else:
            app.post(path)(endpoint)
    return app


JSON = "application/json"
CASES = [  # (path, content type or None, body)
    ("/order", JSON, b'{"name": "ada", "count": 3, "ratio": 0.5, "tags": ["x"]}'),
    ("/order", "application/json; charset=utf-8", b'{"name": "ada"}'),
    ("/order", "application/vnd.order+json", b'{"name": "ada"}'),
    ("/order", "Application/JSON", b'{"name": "ada"}'),
    ("/order", "text/plain", b'{"name": "ada"}'),
    ("/order", None, b'{"name": "ada"}'),
    ("/order", JSON, b'{"name": "ada",'),
    ("/order", JSON, b""),
    ("/order", JSON, b'{"name": "ada", "count": "three"}'),
    ("/order", JSON, b'{"name": "nobody"}'),
    ("/order", JSON, b'{"name": "ada", "ratio": NaN}'),
    ("/order", JSON, b'{"name": "ada", "ratio": 1e400}'),
    ("/order", JSON, b'{"name": "ada", "name": "bob"}'),
    ("/order", JSON, b'["ada"]'),
    ("/order", JSON, '{"name": "\u00e9t\u00e9 \U0001f600"}'.encode()),
    ("/order", JSON, b'{"name": "\xff"}'),
    ("/order", JSON, b'{"name": "conflict"}'),
    ("/v1/completions", JSON, json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4,
                                          "stream": True, "temperature": 0.0}).encode()),
    ("/v1/completions", JSON, json.dumps({"model": "m", "prompt": "hi", "logprobs": 2,
                                          "stop": ["x"], "seed": 7}).encode()),
    ("/v1/completions", JSON, json.dumps({"model": "m"}).encode()),
    ("/v1/completions", JSON, json.dumps({"model": "m", "prompt": "hi", "n": "many"}).encode()),
    ("/v1/chat/completions", JSON, json.dumps({
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "weather?"}]}],
        "tools": [{"type": "function", "function": {
            "name": "weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}}, "required": ["city"]}}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object"}}}}).encode()),
    ("/v1/chat/completions", JSON, json.dumps({
        "model": "m", "messages": [{"role": "user", "content": 5}]}).encode()),
]


async def _answers(app: FastAPI, calls: list[int]) -> tuple[list, list[int]]:
    """Each case's (status, content type, answer), and how often FastAPI solved its body."""
    answers, solved = [], []
    async with served(app) as (_, port), httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}"
    ) as client:
        for path, content_type, body in CASES:
            headers = {"x-agent": "test"}
            if content_type is not None:
                headers["content-type"] = content_type
            before = calls[0]
            reply = await client.post(path, content=body, headers=headers)
            solved.append(calls[0] - before)
            try:
                answer = reply.json()
            except ValueError:
                answer = reply.text
            answers.append((reply.status_code, reply.headers["content-type"], answer))
    return answers, solved


def _counting_dependency_solver(monkeypatch) -> list[int]:
    """Counts FastAPI's dependency solving: its handler's work, which the short way skips."""
    calls = [0]
    solve = fastapi.routing.solve_dependencies

    async def counted(*args, **kwargs):
        calls[0] += 1
        return await solve(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
    return calls


async def test_every_body_gets_the_answer_fastapi_gives(monkeypatch):
    calls = _counting_dependency_solver(monkeypatch)
    plain, plain_solved = await _answers(_app(fast=False), calls)
    fast, fast_solved = await _answers(_app(fast=True), calls)
    for case, want, got in zip(CASES, plain, fast):
        assert got == want, case
    statuses = [status for status, _, _ in plain]
    assert statuses.count(200) >= 8 and statuses.count(422) >= 6 and 409 in statuses
    # The short way took every valid JSON body (the endpoint ran: 200, its own 409, or 500 where
    # its answer holds a float JSON cannot carry, as on FastAPI's route), FastAPI's
    # handler the rest, as it does every body on its own route.
    assert plain_solved.count(1) >= len(CASES) - 3
    for case, (status, _, _), solved, solved_plain in zip(CASES, plain, fast_solved, plain_solved):
        short = status in (200, 409, 500) and case[1] not in (None, "text/plain")
        assert solved == (0 if short else solved_plain), case


async def test_an_endpoint_that_takes_more_than_body_and_request_is_refused():
    async def paged(body: _Order, http: HttpRequest, page: int = 0):
        return {}

    async def bodiless(http: HttpRequest):
        return {}

    for endpoint in (paged, bodiless):
        with pytest.raises(TypeError, match="takes \\(body model, request\\)"):
            post_json(FastAPI(), "/x", endpoint)
