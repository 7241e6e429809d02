"""The ingress's check that the workers can compile a request's grammar, so that a schema
the grammar library refuses is a 400 before any work is queued; verdicts are remembered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar_spec import GrammarSpec

# Specs the ingress remembers having checked: a repeat costs a dictionary lookup.
CHECKED_GRAMMARS = 1024


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
            # The grammar library loads torch: the ingress imports it only once a request
            # asks for a grammar.
            from pdserve.engine.grammar import check_grammar

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
