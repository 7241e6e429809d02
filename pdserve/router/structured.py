"""A request's output constraint: `response_format`'s schema, or a forced tool call's, as the
grammar spec the workers compile; checked here so that a bad schema is a 400 before any work.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar import check_grammar
from pdserve.engine.grammar_spec import GrammarSpec
from pdserve.router.tools import ToolChoice, ToolDefinition, call_schema, forced_functions

# Specs the ingress remembers having checked: a repeat costs a dictionary lookup.
CHECKED_GRAMMARS = 1024


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


class GrammarChecks:
    """The ingress's verdicts on specs it checked (bounded, least recently used go first)."""

    def __init__(self, capacity: int = CHECKED_GRAMMARS) -> None:
        self.capacity = capacity
        self._verdicts: OrderedDict[GrammarSpec, str | None] = OrderedDict()
        self._lock = threading.Lock()  # prompts are built on several worker threads

    def check(self, spec: GrammarSpec | None) -> None:
        """Raises InvalidRequestError (a 400) saying why the workers could not compile
        ``spec``."""
        if spec is None:
            return
        with self._lock:
            known = spec in self._verdicts
            why = self._verdicts.get(spec)
            if known:
                self._verdicts.move_to_end(spec)
        if not known:
            try:
                check_grammar(spec)
            except InvalidRequestError as exc:
                why = str(exc)
            with self._lock:
                self._verdicts[spec] = why
                while len(self._verdicts) > self.capacity:
                    self._verdicts.popitem(last=False)
        if why is not None:
            raise InvalidRequestError(why)
