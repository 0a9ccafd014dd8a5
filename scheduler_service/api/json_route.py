"""The doors' generating routes: a valid JSON body goes straight to the endpoint.

FastAPI spends a good part of a request on its general machinery before the endpoint runs: the
body parsed to Python objects, then validated against the model as a dependency among
dependencies, each step through its telemetry hooks. For the routes that admit requests
(completions, chat, messages, responses) that machinery is a fixed cost on every stream, paid in
the same process that writes every stream's tokens. A `JsonBodyRoute` first tries the short way:
a JSON body that pydantic validates from its bytes in one call goes to the endpoint directly.
Everything else (another content type, a body that is not JSON, a field out of its model, a
body that could not be read) takes FastAPI's own handler, which words the error exactly as the
other routes do; the body read here is cached on the request, so that handler reads it again.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response


def post_json(app: FastAPI, path: str, endpoint: Callable[..., Any]) -> None:
    """POST `path` served by `endpoint(body, request)`, the body a pydantic model."""
    app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=JsonBodyRoute)


def _json_content_type(value: str) -> bool:
    """What FastAPI reads as JSON: application/json or application/*+json, any parameters."""
    media = value.partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


class JsonBodyRoute(APIRoute):
    """An APIRoute whose endpoint takes exactly (body model, request)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        fastapi_handler = super().get_route_handler()
        model, body_name, request_name = self._parameters()
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            if not _json_content_type(request.headers.get("content-type", "")):
                return await fastapi_handler(request)
            try:
                raw = await request.body()
                body = model.model_validate_json(raw)
            except Exception:  # (unread or invalid) FastAPI's handler says what is wrong
                return await fastapi_handler(request)
            result = await endpoint(**{body_name: body, request_name: request})
            if isinstance(result, Response):
                return result
            # As FastAPI answers a route without a response model.
            return JSONResponse(jsonable_encoder(result))

        return handler

    def _parameters(self) -> tuple[type[BaseModel], str, str]:
        """The endpoint's body model and the names it takes the body and the request by."""
        dependant = self.dependant
        body = dependant.body_params
        others = (
            dependant.path_params,
            dependant.query_params,
            dependant.header_params,
            dependant.cookie_params,
            dependant.dependencies,
        )
        request_name = dependant.request_param_name
        if len(body) != 1 or any(others) or request_name is None:
            raise TypeError(f"{self.path}: a JSON route's endpoint takes (body model, request)")
        model = body[0].field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{self.path}: the body must be a pydantic model, got {model!r}")
        return model, body[0].name, request_name
