"""A request's output constraint: `response_format`'s schema, or a forced tool call's, as the
grammar spec the workers compile (`grammar_checks.py` checks it at the ingress first).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar_spec import GrammarSpec
from pdserve.router.tools import ToolChoice, ToolDefinition, call_schema, forced_functions


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow BaseModel's method; the wire name stays OpenAI's.
    json_schema: dict[str, Any] | bool = Field(
        default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = Field(None, description="Accepted: the output always follows the "
                                "schema, strict or not.")


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {name, schema, strict}}``."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format needs json_schema exactly when its type is "
                             "\"json_schema\"")
        return self


def grammar_of(response_format: ResponseFormat | None,
               tools: list[ToolDefinition] | None = None,
               tool_choice: ToolChoice | None = None) -> GrammarSpec | None:
    """The constraint on the answer (None: free text). A call forced by ``tool_choice``
    (required, or a named function) follows its function's parameter schema."""
    functions = forced_functions(tools, tool_choice)
    if functions:
        if response_format is not None and response_format.type != "text":
            raise InvalidRequestError("response_format cannot be combined with a forced tool "
                                      "call (tool_choice \"required\" or a named function)")
        return GrammarSpec.tool_call(call_schema(functions))
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec.json_object()
    assert response_format.json_schema is not None
    return GrammarSpec.json_schema(response_format.json_schema.json_schema)
