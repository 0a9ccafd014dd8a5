"""Reasoning output: a thinking model's think block split from its answer (`--reasoning-parser`).

The text between `<think>` and `</think>` is the reasoning (OpenAI-compatible servers send it as
`reasoning_content`); the rest is the content. Two families, as vLLM names them:

    qwen3        the model writes `<think>` itself; an output that does not start with it has
                 no reasoning (Qwen3 with thinking off)
    deepseek_r1  the chat template already wrote `<think>` into the prompt: the output is
                 reasoning from its first token until `</think>` (a `<think>` it writes again
                 is dropped)

A think block cut before `</think>` (max_tokens) stays reasoning. A request with a grammar
(structured output, "required" or a named tool) is constrained only after `</think>`
(`grammar_after`): the thinking stays free. Streaming holds back only a
tail that may still grow into a marker, so reasoning and content stream as they come and the
split is the same whatever the chunks.
"""

from __future__ import annotations

from scheduler_service.text.tool_parsers.base import marker_hold

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def grammar_after(parser: str, prompt_tail: str) -> tuple[bytes, bytes]:
    """(after, opens): the markers a grammar's guide waits for under `parser` (text/guides.py):
    the end of thinking, and for qwen3 the start the output may open with (without it the
    grammar applies from the first token). (b"", b"") without a parser, or when the prompt's
    tail already closed its think block (Qwen3 with thinking off: the template writes an empty
    block), as vLLM decides it from the prompt's tokens."""
    if not parser or prompt_tail.rfind(END) > prompt_tail.rfind(START):
        return b"", b""
    return END.encode(), START.encode() if parser == "qwen3" else b""


class ReasoningSplit:
    """One sample's split; `feed` its text as it comes, `finish` once it ended. Each returns
    (reasoning, content) that may be sent now."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; valid: {', '.join(PARSERS)}")
        # "start": not yet known whether the output opens a think block (qwen3 only).
        self.state = "start" if parser == "qwen3" else "reasoning"
        self._opening = parser == "deepseek_r1"  # a leading <think> is dropped, once
        self._held = ""

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._held:
            text = self._held
            if self.state == "start" or self._opening:
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self._held, self._opening = stripped[len(START) :], False
                    self.state = "reasoning"
                    continue
                if not final and START.startswith(stripped):
                    break  # may still become <think>
                self._opening = False
                if self.state == "start":
                    self.state = "content"
                continue
            if self.state == "content":
                content.append(text)
                self._held = ""
                break
            at = text.find(END)
            if at < 0:  # still thinking: hold only a tail that may grow into </think>
                hold = len(text) if final else marker_hold(text, END)
                reasoning.append(text[:hold])
                self._held = text[hold:]
                break
            reasoning.append(text[:at])
            self._held, self.state = text[at + len(END) :], "content"
        if final and self._held:  # a tail that never became a marker
            (content if self.state == "content" else reasoning).append(self._held)
            self._held = ""
        return "".join(reasoning), "".join(content)

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)
