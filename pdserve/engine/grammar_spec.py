"""What constrains a request's output: a grammar's kind and source, as it travels with the request.

Plain data without torch or the grammar library: the ingress builds it, every worker compiles it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.engine.errors import InvalidRequestError

GrammarKind = Literal["json_object", "json_schema", "tool_call"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_object", "json_schema", "tool_call")
# The text around a tool call's JSON, Hermes/Qwen style (the chat template shows the same).
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"


@dataclass(frozen=True)
class GrammarSpec:
    """``json_object``: any JSON object; ``json_schema``: a JSON value valid for ``source``;
    ``tool_call``: one ``<tool_call>`` block whose JSON is valid for ``source``.

    ``source`` is the schema as compact JSON, keys in the order given (properties come out in
    the schema's order), so equal schemas make equal specs: the spec itself is the compile
    cache's key on every worker."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {GRAMMAR_KINDS}, "
                                      f"got {self.kind!r}")
        if not isinstance(self.source, str):
            raise InvalidRequestError(f"grammar source must be a string, got {self.source!r}")
        if (self.kind == "json_object") != (self.source == ""):
            raise InvalidRequestError(f"a {self.kind} grammar "
                                      f"{'takes no' if self.kind == 'json_object' else 'needs a'}"
                                      " schema")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool) -> GrammarSpec:
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def tool_call(cls, schema: Mapping[str, Any]) -> GrammarSpec:
        return cls("tool_call", canonical_json(schema))

    def schema(self) -> Any:
        """The schema as data (json_object: any object)."""
        return json.loads(self.source) if self.source else {"type": "object"}


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
