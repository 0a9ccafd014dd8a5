"""A response's usage in OpenAI's shape, over a request's n samples."""

from __future__ import annotations

from scheduler_service.core.request import Request, RequestOutput


class Totals:
    """Usage over a request's n samples: one prompt, every sample's completion tokens."""

    def __init__(self, req: Request):
        self.prompt_tokens = len(req.prompt_token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0

    def add(self, output: RequestOutput) -> None:
        if output.usage is not None:
            self.completion_tokens += output.usage.completion_tokens
            self.cached_tokens = max(self.cached_tokens, output.usage.cached_tokens)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
