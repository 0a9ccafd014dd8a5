"""Where a request's text is made behind frontend processes.

A request without stop strings has text that is a function of its tokens alone, so its frontend
makes it (vLLM's API servers detokenize the same way) and the engine core sends token ids only:
the core's step loses its per-token detokenizing. A request with stop strings is detokenized in the
core, as without frontends: a stop string ends the request in the step that completes it, so it
never computes past it and no text beyond it reaches the client.
"""

from __future__ import annotations

from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.text.detokenizer import IncrementalDetokenizer
from scheduler_service.text.tokenizer import Tokenizer


def made_by_frontend(request: Request) -> bool:
    """Whether the frontend makes the request's text (the rule both sides follow)."""
    return not request.stopping.stop_strings


class FrontendText:
    """The text of a frontend's requests that it makes: one incremental detokenizer per sample,
    fed each output's tokens in order (the core never sends a token twice, even across a
    preemption or an engine restart)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._samples: dict[tuple[str, int], IncrementalDetokenizer] = {}

    def fill(self, request: Request, output: RequestOutput) -> None:
        """Sets the output's text from its tokens (a final output takes what is left)."""
        key = (request.request_id, output.index)
        detokenizer = self._samples.get(key)
        if detokenizer is None:
            detokenizer = self._samples[key] = IncrementalDetokenizer(
                self._tokenizer, request.prompt_token_ids, ()
            )
        for token_id in output.token_ids:
            detokenizer.add_token(token_id)
        output.text = detokenizer.take_text(final=output.finish_reason is not None)
        if output.finish_reason is not None:
            del self._samples[key]

    def clear(self) -> None:
        self._samples.clear()
