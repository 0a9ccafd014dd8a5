"""An error of the HTTP doors in OpenAI's shape (status, message, type, param, code), with
Retry-After when the server asks the client to come back later."""

from __future__ import annotations

from typing import Mapping, Optional

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        retry_after_ms: Optional[int] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.retry_after_ms = retry_after_ms

    def response(self, headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
        if self.retry_after_ms is not None:
            # HTTP's Retry-After counts whole seconds; round up so a client never comes too early.
            headers = dict(headers or {}, **{"Retry-After": str(-(-self.retry_after_ms // 1000))})
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse(status_code=self.status, headers=headers, content={"error": error})
