"""OpenAI's two logprobs shapes from the engines' `TokenLogprobs`: chat's per-token entries
and the legacy completions' parallel lists. Token text and bytes come from the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.protocol_responses import (
    ChoiceLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)


class LogprobsFormatter:
    """Formats the logprobs of one response's tokens; ``text_offset`` counts on from one
    call to the next, so a stream's chunks and a whole response agree."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text_offset = 0

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        data = self._tokenizer.token_bytes(token_id)
        # A token holding part of a UTF-8 character shows as U+FFFD; its bytes stay exact.
        return data.decode("utf-8", errors="replace"), list(data)

    def chat(self, entries: Sequence[TokenLogprobs]) -> ChoiceLogprobs:
        content = []
        for entry in entries:
            token, data = self._token(entry.token_id)
            top = [TopLogprob(token=text, logprob=logprob, bytes=raw)
                   for text, raw, logprob in ((*self._token(tid), lp) for tid, lp in entry.top)]
            content.append(TokenLogprob(token=token, logprob=entry.logprob, bytes=data,
                                        top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def completion(self, entries: Sequence[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries:
            token = self._token(entry.token_id)[0]
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            # Alternatives that render alike (partial characters) keep the likeliest's value.
            top: dict[str, float] = {}
            for token_id, logprob in entry.top:
                top.setdefault(self._token(token_id)[0], logprob)
            out.top_logprobs.append(top if entry.top else None)
            out.text_offset.append(self._text_offset)
            self._text_offset += len(token)
        return out
