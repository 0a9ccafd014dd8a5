"""Tools and reasoning output on the gRPC door: GenerateRequest's tools, tool_choice,
parallel_tool_calls and tool turns, GenerateResponse's reasoning and tool_calls (fields
240-259).

The gRPC door does what the HTTP door does, with the same code: the fields are handed in
OpenAI's shape to the doors' one planner (api/tool_requests.py), the conversation is rendered by
api/tool_turns.py into the prompt's token ids ("required" or a named function adds its calls'
grammar), and each sample's text is split by api/chat_outputs.py. A refusal is INVALID_ARGUMENT
naming the GenerateRequest's field.

    tool_requests path (OpenAI's)       GenerateRequest field
    tools[i].function.name              tools[i].name
    tool_choice.function.name           tool_choice.function
    messages[i].tool_calls[j]...        messages.messages[i].tool_calls[j]...
"""

from __future__ import annotations

import json
from typing import Any, Optional

from planserve.v1 import generate_pb2
from scheduler_service.api import chat_outputs, tool_requests, tool_turns
from scheduler_service.api.admission import Rejected
from scheduler_service.api.chat_outputs import ChatOutput
from scheduler_service.api.tool_requests import ToolError, ToolPlan
from scheduler_service.config import SchedulerConfig
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.text import outputs, tool_parsers
from scheduler_service.text.tokenizer import Tokenizer

_MODES = {
    generate_pb2.TOOL_CHOICE_MODE_NONE: "none",
    generate_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    generate_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}
_ROLES = ("system", "user", "assistant", "tool")


def _proto_path(path: str) -> str:
    """A tool_requests path (OpenAI's spelling) as the GenerateRequest's field path."""
    path = path.replace(".function.", ".")
    return "tool_choice.function" if path == "tool_choice.name" else path


def _tools(pb: generate_pb2.GenerateRequest) -> list[dict[str, Any]]:
    tools = []
    for index, tool in enumerate(pb.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except json.JSONDecodeError as error:
                detail = f"not valid JSON ({error})"
                raise ToolError("tools", f"tools[{index}].parameters", detail) from None
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(pb: generate_pb2.GenerateRequest) -> Any:
    if not pb.HasField("tool_choice"):
        return None
    kind = pb.tool_choice.WhichOneof("choice")
    if kind == "function":
        return {"type": "function", "function": {"name": pb.tool_choice.function}}
    if kind is None or pb.tool_choice.mode not in _MODES:
        raise ToolError(
            "tool_choice",
            "tool_choice",
            "one of mode (none, auto, required) or function must be set",
        )
    return _MODES[pb.tool_choice.mode]


def _turns(messages) -> list[dict[str, Any]]:
    """The ChatMessages as chat template turns (tool_turns' shape)."""
    turns = []
    for index, message in enumerate(messages):
        where = f"messages.messages[{index}]"
        if message.role not in _ROLES:
            raise ToolError(
                "messages",
                f"{where}.role",
                f"must be system, user, assistant or tool, got {message.role!r}",
            )
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            if message.role != "assistant":
                raise ToolError("messages", f"{where}.tool_calls", "only on assistant turns")
            turn["tool_calls"] = [
                tool_turns.call_turn(
                    f"{where}.tool_calls[{number}]", call.id, call.name, call.arguments or "{}"
                )
                for number, call in enumerate(message.tool_calls)
            ]
        if message.role == "tool":
            turn["tool_call_id"] = message.tool_call_id
        turns.append(turn)
    return turns


def _uses_tools(pb: generate_pb2.GenerateRequest) -> bool:
    chat = pb.WhichOneof("prompt") == "messages"
    turns = chat and any(m.tool_calls or m.role == "tool" for m in pb.messages.messages)
    return bool(pb.tools) or pb.HasField("tool_choice") or turns


class ChatChunks:
    """A request's chunks with each sample's text split into reasoning, content and calls."""

    def __init__(self, splits: list[ChatOutput]):
        self._splits = splits

    def to_pb(self, req: Request, output: RequestOutput) -> generate_pb2.GenerateResponse:
        chunk = outputs.to_pb(req, output)
        split = self._splits[output.index]
        chunk.reasoning, chunk.text, calls = split.step(output.text, output.finish_reason)
        for call in calls:
            function = call["function"]
            chunk.tool_calls.add(
                id=call["id"], name=function["name"], arguments=function["arguments"]
            )
        return chunk


class ChatDoor:
    """The gRPC door's tool settings (the server's, as the HTTP door reads them)."""

    def __init__(self, config: SchedulerConfig):
        self.parser: Optional[tool_parsers.ToolParser] = None
        if config.enable_auto_tool_choice:
            self.parser = tool_parsers.create(config.tool_call_parser)
        self.reasoning_parser = config.reasoning_parser

    def prepare(
        self, pb: generate_pb2.GenerateRequest, tokenizer: Tokenizer
    ) -> tuple[generate_pb2.GenerateRequest, Optional[ToolPlan], str]:
        """(the request admission takes, its tool plan, its reasoning parser): a request with
        tools or tool turns gets its prompt rendered here (a copy; the client's is kept).
        Rejected (INVALID_ARGUMENT naming the field) for bad tools."""
        reasoning = self.reasoning_parser if pb.WhichOneof("prompt") == "messages" else ""
        if not _uses_tools(pb):
            return pb, None, reasoning
        if pb.WhichOneof("prompt") != "messages":
            raise Rejected.invalid("tools", "need a messages prompt")
        grammar = "structured_output" if pb.HasField("structured_output") else None
        auto = self.parser.name if self.parser is not None else None
        try:
            plan = tool_requests.plan_tools(
                _tools(pb),
                _tool_choice(pb),
                pb.parallel_tool_calls if pb.HasField("parallel_tool_calls") else None,
                grammar,
                auto,
            )
            ids = tool_turns.prompt_ids(_turns(pb.messages.messages), plan, tokenizer)
        except ToolError as error:
            raise Rejected.invalid(_proto_path(error.path), error.detail) from None
        rendered = generate_pb2.GenerateRequest()
        rendered.CopyFrom(pb)
        rendered.token_ids.ids[:] = ids
        schema = plan.grammar_schema() if plan is not None else None
        if schema is not None:
            rendered.structured_output.json_schema = json.dumps(schema, ensure_ascii=False)
        return rendered, plan, reasoning

    @staticmethod
    def reworded(rejected: Rejected, plan: Optional[ToolPlan]) -> Rejected:
        """A refusal of the calls' grammar names `tools` (the client sent no grammar), worded as
        the HTTP door words it."""
        field = rejected.field or ""
        if plan is None or not plan.guided or not field.startswith("structured_output"):
            return rejected
        return Rejected.invalid("tools", f"({field}) {rejected.detail}")

    def chunks(
        self, req: Request, plan: Optional[ToolPlan], reasoning: str
    ) -> Optional[ChatChunks]:
        """The request's chunk builder; None when its chunks are plain (outputs.to_pb)."""
        splits = chat_outputs.for_samples(req, plan, self.parser, reasoning)
        return ChatChunks(splits) if splits is not None else None
