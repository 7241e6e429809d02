"""A streamed answer split into content and OpenAI tool-call deltas as its text arrives.

A call's id and name go out once its JSON names the function; its arguments then follow as they
are generated, less the text that may still turn out to close the call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.engine.grammar_spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from pdserve.router.tools import new_call_id, parse_call

_OPEN = TOOL_CALL_OPEN.strip()
_CLOSE = TOOL_CALL_CLOSE.strip()
# What a call's JSON starts with: its name, then its arguments (the order the grammar and the
# chat template both write).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of call ``index``: its id and name in the first piece only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, object]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """Feed it an answer's text pieces; it returns the content to show and the call deltas."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._arguments_at: int | None = None  # where the open call's arguments start
        self._num_sent = 0  # characters of the open call's arguments already sent
        self.num_calls = 0  # calls whose first delta went out

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if not self._in_call:
                start = self._buffer.find(_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, _OPEN)
                    content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return content, calls
                content += self._buffer[:start]
                self._buffer = self._buffer[start + len(_OPEN):]
                self._in_call, self._arguments_at, self._num_sent = True, None, 0
                continue
            end = self._buffer.find(_CLOSE)
            if end < 0:
                calls += self._open_call_progress()
                return content, calls
            body, self._buffer = self._buffer[:end], self._buffer[end + len(_CLOSE):]
            self._in_call = False
            closed = self._closed_call(body)
            if closed is None:  # not a call after all: what the model wrote is content
                content += _OPEN + body + _CLOSE
            calls += closed or []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is held back when the answer ends (a call cut short keeps what it has)."""
        if not self._in_call:
            content, self._buffer = self._buffer, ""
            return content, []
        calls = self._open_call_progress(final=True)
        if self._arguments_at is None:
            content, self._buffer = _OPEN + self._buffer, ""
            return content, calls
        return "", calls

    def _open_call_progress(self, final: bool = False) -> list[ToolCallDelta]:
        deltas = []
        if self._arguments_at is None:
            header = _HEADER.match(self._buffer)
            if header is None:
                return []
            self._arguments_at = header.end()
            deltas.append(ToolCallDelta(self.num_calls, "", new_call_id(), header.group(1)))
            self.num_calls += 1
        arguments = self._buffer[self._arguments_at:]
        if self._num_sent == 0:  # the space after "arguments": may come in a later piece
            self._arguments_at += len(arguments) - len(arguments.lstrip())
            arguments = arguments.lstrip()
        # The call's own closing brace comes last: hold back from the last brace on.
        ready = arguments if final else arguments[:max(arguments.rfind("}"), 0)]
        if len(ready) > self._num_sent:
            deltas.append(ToolCallDelta(self.num_calls - 1, ready[self._num_sent:]))
            self._num_sent = len(ready)
        return deltas

    def _closed_call(self, body: str) -> list[ToolCallDelta] | None:
        if self._arguments_at is None:
            call = parse_call(body)
            if call is None:
                return None
            self.num_calls += 1
            return [ToolCallDelta(self.num_calls - 1, call.function.arguments, call.id,
                                  call.function.name)]
        arguments = body[self._arguments_at:].rstrip().removesuffix("}").rstrip()
        rest = arguments[self._num_sent:]
        return [ToolCallDelta(self.num_calls - 1, rest)] if rest else []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
