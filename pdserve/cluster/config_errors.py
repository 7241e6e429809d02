"""`ConfigError` and the translation of pydantic's errors into ``key.path: problem; fix`` lines.

Every config problem reaches the user through here, named by its dotted YAML key.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

# Error type of the cross-field checks; their ctx carries the full key path.
CROSS_FIELD_ERROR = "pdserve_config"


class ConfigError(ValueError):
    """The config cannot be used; the message names each offending key and how to fix it."""

    def __init__(self, problems: Sequence[str], source: str = "config") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {source}:\n{lines}")


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``X | None`` (or ``Annotated``/``Optional``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_class(arg)
            if found is not None:
                return found
    return None


def _allowed_keys(root: type[BaseModel], parent: Sequence[str | int]) -> list[str]:
    model: type[BaseModel] | None = root
    for part in parent:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        model = _model_class(model.model_fields[part].annotation)
    return sorted(model.model_fields) if model is not None else []


def _is_union_tag(part: str | int) -> bool:
    # pydantic inserts the union member's name ("str", "dict[str,float]") into error locs.
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool",
                                                              "none", "list", "dict"})


def _describe(error: dict[str, Any], root: type[BaseModel]) -> list[str]:
    loc = [p for p in error["loc"] if not _is_union_tag(p)]
    ctx = error.get("ctx") or {}
    if error["type"] == CROSS_FIELD_ERROR:
        return list(ctx["problems"])
    return [_describe_field(error, loc, root)]


def _describe_field(error: dict[str, Any], loc: list[str | int], root: type[BaseModel]) -> str:
    key = ".".join(str(p) for p in loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(root, loc[:-1])
        hint = ""
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
        return (f"{key}: unknown key{hint}; remove it. Allowed here: "
                f"{', '.join(allowed) or 'none'}")
    if error["type"] == "missing":
        return f"{key}: required key is missing; add it"
    message = str(error["msg"]).removeprefix("Value error, ")
    # Echo the wrong value to help, except where it may be a secret.
    if "input" in error and error["type"].endswith("_type") and "auth_token" not in loc:
        message += f" (got {error['input']!r} of type {type(error['input']).__name__})"
    return f"{key}: {message}"


def config_error_from(exc: ValidationError, root: type[BaseModel], source: str) -> ConfigError:
    """One ConfigError listing every problem pydantic found, each as ``key.path: text``."""
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        for line in _describe(dict(error), root):
            if line not in problems:
                problems.append(line)
    return ConfigError(problems, source)
