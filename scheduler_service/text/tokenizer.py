"""Tokenization on the scheduler side, from what the model service's Describe sent.

The scheduler needs no model files: the tokenizer arrives as a Hugging Face tokenizer.json
document and the chat template as Jinja2 source, rendered the way `transformers` renders it
(sandboxed, trim_blocks and lstrip_blocks on, `raise_exception` available).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
import tokenizers.decoders

# Prompt tokens a stream of generated text is decoded after, so that merges at the seam (leading
# spaces, multi-token characters) come out as they would in a full decode.
_STREAM_CONTEXT_TOKENS = 5


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


@dataclasses.dataclass(frozen=True)
class ChatTemplateOptions:
    """How a request asks its conversation rendered (vLLM's and transformers' names): with the
    assistant's prompt after it (add_generation_prompt), or with its last, assistant, message
    left open for the model to go on with (continue_final_message); `kwargs` go to the template
    beside the messages (`enable_thinking` for Qwen3's)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def _open_final_message(text: str, content: str) -> str:
    """The rendered conversation cut right after its last message's content, as transformers'
    continue_final_message cuts it (what the template writes after a turn is dropped)."""
    content = content.strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise ValueError("the chat template does not write the final message's content as given")
    return text[: at + len(content)]


class Tokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str, special_tokens: dict[str, str]):
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._special_tokens = dict(special_tokens)
        self._chat_template = None
        # A template that mentions `tools` renders them (transformers' convention); others get
        # planserve's default tool format (text/tool_prompt.py).
        self.supports_tools = "tools" in chat_template
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = lambda value, indent=None: json.dumps(
                value, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise_exception
            self._chat_template = env.from_string(chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain-text prompt, with whatever special tokens the tokenizer adds
        (none with add_special_tokens=False)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Optional[list[dict[str, Any]]] = None,
        options: Optional[ChatTemplateOptions] = None,
    ) -> str:
        """The conversation rendered by the chat template, with the assistant prompt; `tools`
        (OpenAI's tool objects) are passed to the template as transformers passes them, and
        `options` (a request's) as their ChatTemplateOptions says."""
        if self._chat_template is None:
            raise ValueError("the model has no chat template")
        options = options or ChatTemplateOptions()
        extra = {"tools": tools} if tools else {}
        text = self._chat_template.render(
            messages=list(messages),
            add_generation_prompt=options.add_generation_prompt,
            **extra,
            **self._special_tokens,
            **options.kwargs,
        )
        if options.continue_final_message:
            text = _open_final_message(text, messages[-1].get("content") or "")
        return text

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None
    ) -> list[int]:
        """Token ids of render_chat's text."""
        # The template already wrote every special token it wants.
        text = self.render_chat(messages, tools)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_token_ids: Sequence[int]) -> Callable[[int], Optional[str]]:
        """A function giving the text each next generated token adds after the prompt (None or
        "" while the text ends inside a character): tokenizers' incremental decoder, which keeps
        its offsets in Rust and decodes each token's window once, where decoding the window with
        and without the newest token from Python took two decode calls a token."""
        stream = tokenizers.decoders.DecodeStream(
            ids=list(prompt_token_ids[-_STREAM_CONTEXT_TOKENS:]), skip_special_tokens=True
        )
        return functools.partial(stream.step, self._tokenizer)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tokenizer.token_to_id(token)
