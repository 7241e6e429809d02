"""Streams a request's text while watching for stop strings.

Text that could still become a stop string is held back, so a client never sees part of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextStream:
    """Detokenizes one request's output and finds the first stop string in it."""

    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    emitted: int = 0  # characters of detokenizer.text already handed out
    stopped: bool = False
    final_text: str | None = field(default=None)

    @classmethod
    def create(cls, tokenizer: Tokenizer, stop: tuple[str, ...]) -> TextStream:
        return cls(IncrementalDetokenizer(tokenizer), tuple(s for s in stop if s))

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that is now safe to show."""
        if self.stopped:
            return ""
        piece = self.detokenizer.add(token_id)
        if not self.stop:  # nothing to hold back: every completed piece is shown at once
            self.emitted += len(piece)
            return piece
        text = self.detokenizer.text
        # A stop string can straddle earlier text: search from where it could start.
        search_from = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.final_text = text[: min(hits)]
            return self._emit_upto(len(self.final_text))
        return self._emit_upto(len(text) - self._held_back(text))

    def flush(self) -> str:
        """The request finished for another reason: release what was held back."""
        if self.stopped:
            return ""
        self.detokenizer.flush()
        return self._emit_upto(len(self.detokenizer.text))

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else self.detokenizer.text

    def _held_back(self, text: str) -> int:
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _emit_upto(self, end: int) -> str:
        end = max(end, self.emitted)
        piece = self.detokenizer.text[self.emitted : end]
        self.emitted = end
        return piece
