"""A response's usage in OpenAI's shape, over its requests (a completion's one per prompt) and
their n samples."""

from __future__ import annotations

from scheduler_service.core.request import Request, RequestOutput


class Totals:
    """Usage over an answer's requests, its outputs' indices their choices' (prompt p's samples
    are choices p*n .. p*n+n-1): each prompt once, every sample's completion tokens."""

    def __init__(self, requests: list[Request]):
        self.prompt_tokens = sum(len(request.prompt_token_ids) for request in requests)
        self._n = requests[0].n
        self._cached_tokens: dict[int, int] = {}  # per prompt: what its samples found cached
        self.completion_tokens = 0

    def add(self, output: RequestOutput) -> None:
        if output.usage is not None:
            self.completion_tokens += output.usage.completion_tokens
            prompt = output.index // self._n
            cached = max(self._cached_tokens.get(prompt, 0), output.usage.cached_tokens)
            self._cached_tokens[prompt] = cached

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())},
        }
