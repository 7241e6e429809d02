"""Function tools of a chat request: their OpenAI schema, what the chat template sees, the
schema a forced call must follow, and the calls read back from the generated text.

A call is Hermes/Qwen-style text: ``<tool_call>``, a newline, ``{"name": ..., "arguments":
{...}}``, a newline, ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.engine.grammar_spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# OpenAI's rule for function names.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(TOOL_CALL_OPEN.strip()) + r"\s*(.*?)\s*"
                   + re.escape(TOOL_CALL_CLOSE.strip()), re.DOTALL)


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class FunctionDefinition(_Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                               "properties": {}})
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _openai_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"function name {value!r} must be 1-64 letters, digits, _ or -")
        return value


class ToolDefinition(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Part):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def template_tools(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools as the chat template renders them (OpenAI's shape)."""
    return [tool.model_dump(mode="json", exclude_none=True) for tool in tools]


def template_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant's past calls as the chat template renders them: arguments as data when
    they are JSON (the template writes them as JSON again), else as the text sent."""
    rendered = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        rendered.append({"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": arguments}})
    return rendered


def forced_functions(tools: list[ToolDefinition] | None,
                     choice: ToolChoice | None) -> list[FunctionDefinition]:
    """The functions one of which the answer must call ([]: no call is forced)."""
    if not tools or choice in (None, "none", "auto"):
        return []
    if isinstance(choice, NamedToolChoice):
        return [t.function for t in tools if t.function.name == choice.function.name]
    return [t.function for t in tools]


def call_schema(functions: list[FunctionDefinition]) -> dict[str, Any]:
    """The JSON schema of a call to one of ``functions``: its name, then its arguments."""
    options = [{"type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}
               for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> ToolCall | None:
    """A ``<tool_call>`` block's JSON as a call (None: not a call's JSON)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=data["name"], arguments=text))


def split_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (content, calls): the text around well-formed ``<tool_call>`` blocks
    is the content (None when only blank text is left beside calls)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _CALL.finditer(text):
        call = parse_call(match.group(1))
        if call is None:
            continue
        kept.append(text[position:match.start()])
        calls.append(call)
        position = match.end()
    if not calls:
        return text, []
    content = "".join(kept) + text[position:]
    return (content if content.strip() else None), calls
