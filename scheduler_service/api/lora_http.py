"""LoRA adapters on the HTTP door, as vLLM serves them: /v1/models lists each adapter (`parent`:
the base model, `root`: its folder), POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"} (engine/lora_admin.py does the work; docs/lora.md).

Answers: 200 with vLLM's text on success; 404 when run-time loading is off (--enable-runtime-lora)
or the name is unknown; 400 naming the field for a bad name or a path outside --lora-root (or one
the model service refuses); 409 for a name already loaded, or an unload while requests use it;
503 when no model service can take it now.
"""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from scheduler_service.api.admission import Admission
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.core.lora_registry import LoraError, LoraRegistry
from scheduler_service.engine.client import EngineFacts

_STATUS = {"invalid": 400, "not_found": 404, "conflict": 409, "unavailable": 503}
_TYPE = {
    "invalid": "invalid_request_error",
    "not_found": "not_found_error",
    "conflict": "conflict_error",
    "unavailable": "service_unavailable",
}


class LoadLoraAdapterRequest(pydantic.BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(pydantic.BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


def api_error(error: LoraError) -> ApiError:
    code = "model_not_found" if error.kind == "not_found" and error.field else None
    return ApiError(
        _STATUS[error.kind], error.message, _TYPE[error.kind], param=error.field or None, code=code
    )


def models(facts: EngineFacts, registry: LoraRegistry) -> dict[str, Any]:
    """/v1/models: the base model, then each adapter with its parent and root (vLLM's fields)."""
    base = {
        "id": facts.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "planserve",
        "root": facts.model_name,
        "parent": None,
        "max_model_len": facts.max_model_len,
    }
    adapters = [
        {
            "id": adapter.name,
            "object": "model",
            "created": 0,
            "owned_by": "planserve",
            "root": adapter.path,
            "parent": facts.model_name,
            "max_model_len": facts.max_model_len,
        }
        for adapter in registry.adapters.values()
    ]
    return {"object": "list", "data": [base, *adapters]}


def add_routes(app: FastAPI, admission: Admission) -> None:
    """The load and unload routes (closed doors answer 404 when run-time loading is off)."""

    def serving():
        if admission.serving is None:
            raise ApiError(
                503, "the model service has not answered Describe yet", "service_unavailable"
            )
        return admission.serving

    async def load(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        current = serving()
        try:
            await admission.loras.load(
                current.frontend, current.facts, body.lora_name, body.lora_path
            )
        except LoraError as error:
            raise api_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        current = serving()
        try:
            await admission.loras.unload(current.frontend, body.lora_name)
        except LoraError as error:
            raise api_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    app.post("/v1/load_lora_adapter")(load)
    app.post("/v1/unload_lora_adapter")(unload)
