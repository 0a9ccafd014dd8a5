"""Python view of cython_ext/step_outputs.pyx."""
from collections.abc import Callable, Collection
from typing import Any, Optional

def take_plain_tokens(
    requests: list[Any],
    sampled: list[int],
    counts: list[int],
    live: Collection[int],
    placeholders: dict[int, Optional[int]],
    core: Any,
    held: dict[str, Any],
    detokenizers: dict[str, Any],
    no_text: Any,
    output_type: Callable[..., Any],
    max_model_len: int,
    eos_token_ids: Collection[int],
    now: float,
    slow: Callable[[int, int, int], Optional[Any]],
    outputs: list[tuple[Any, Any]],
) -> None:
    """A step's plain entries (one token that stops nothing, no logprobs, grammar, stop strings
    or samples to fork) taken into their requests in C; every other entry handed to
    `slow(index, offset, count)` in its turn. Outputs go to `outputs` in entry order."""

def put_outputs(outputs: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Each (request, output) into `request.outputs.put_nowait`, in order; returns the pairs
    whose output is its sample's last."""

def note_token_times(
    outputs: list[tuple[Any, Any]], last_token_time: dict[int, float], now: float, gaps: list[float]
) -> tuple[int, list[tuple[Any, Any]]]:
    """Per output with tokens: the gap since its request's previous one into `gaps`, `now` as
    its time (by id(request)); a finished one's forgotten. Returns (tokens, finished pairs)."""

class BatchSink:
    """A request's outputs sink appending (key, output) to a shared batch: on_first() when an
    output finds it empty, on_final(key) after a sample's last output."""

    key: Any
    def __init__(
        self,
        key: Any,
        batch: list[tuple[Any, Any]],
        on_first: Callable[[], None],
        on_final: Callable[[Any], None],
    ) -> None: ...
    def put_nowait(self, output: Any) -> None: ...

def compact_outputs(batch: list[tuple[Any, Any]]) -> list[Any]:
    """(key, output) pairs flat: key, then the one token id, the token ids, or the output (only
    an output of token ids alone travels as its ids); expand_outputs undoes it."""

def expand_outputs(compact: list[Any], output_type: Callable[..., Any]) -> list[tuple[Any, Any]]:
    """key, token id(s) as (key, output_type(token_ids, "")); key, output as (key, output)."""
