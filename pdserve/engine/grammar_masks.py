"""Each step's token mask for the rows whose request follows a grammar; other rows cost nothing.

A request's matcher is rebuilt from its spec wherever it samples and catches up on the request's
output tokens before each mask: prefill's first token, the tokens a recompute resumes from and
tokens kept through a preemption are all simply tokens it has not seen yet.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import xgrammar as xgr

from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.mask_apply import apply_on_cpu, mask_kernel
from pdserve.engine.request import Request

logger = logging.getLogger(__name__)


class _Cursor:
    """One request's matcher and how many of its output tokens it has accepted."""

    def __init__(self, compiled: xgr.CompiledGrammar | None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
        self.num_seen = 0
        self.last_token_id = -1
        # No grammar, or a token the grammar refused: the row is no longer constrained.
        self.broken = self.matcher is None
        # Past the grammar's end (ignore_eos): only stop tokens are offered. Only an accepted
        # token changes it, so it is asked once per token, not once per step and use.
        self.terminated = False

    def catch_up(self, request: Request) -> None:
        output = request.output_token_ids
        while self.num_seen < len(output) and self.matcher is not None and not self.broken:
            token_id = output[self.num_seen]
            self.num_seen += 1
            self.last_token_id = token_id
            if self.terminated:
                continue
            if self.matcher.accept_token(token_id):
                self.terminated = self.matcher.is_terminated()
            else:
                self.broken = True
                logger.warning("request %s: the grammar refused output token %d at %d; its "
                               "later tokens are not constrained", request.request_id, token_id,
                               self.num_seen - 1)


@dataclass(frozen=True)
class StepMask:
    """The step's bitmask (one bit per token: 1 allowed), applied to ``rows`` only: row ``i``
    of the bitmask is sampling row ``i``'s; other rows' words are left as they were."""

    bitmask: torch.Tensor  # int32 [sampling rows, ceil(vocab / 32)], on the CPU
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Set every disallowed token's logit to -inf, in place, in ``rows`` only."""
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            apply_on_cpu(logits, self.bitmask, self.rows)
            return
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        if len(self.rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, bitmask)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)


class GrammarMasks:
    """The runner's per-request matchers (dropped with their requests) and step masks.

    On CUDA (the host thread only waits while the device runs the model: ``overlap``) a
    step's mask is filled on the masks' own thread during the forward pass; the grammar
    library fills all rows in one call that releases the GIL. On CPU the forward pass keeps
    the cores busy, and a second thread there measured slower than filling after it on the
    engine thread (`benchmarks/structured_outputs.py --masks`). The matchers are touched by
    one thread at a time."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.overlap = device.type == "cuda"
        self._cursors: weakref.WeakKeyDictionary[Request, _Cursor] = weakref.WeakKeyDictionary()
        self._bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-masks")
        if device.type == "cpu":
            mask_kernel()  # the C loop is built at start-up, not in a request's step

    def start(self, requests: Sequence[Request]) -> PendingMask | None:
        """The step's mask, for the sampler to take after the forward pass (None: no row
        follows a grammar; nothing to wait for). ``requests`` and their output tokens must
        not change until it is taken."""
        if all(r.sampling_params.grammar is None for r in requests):
            return None
        if self.overlap:
            return self._thread.submit(self.fill, requests)
        return _FillWhenTaken(self, requests)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def fill(self, requests: Sequence[Request]) -> StepMask | None:
        """The mask of the step that samples ``requests`` (None: no row follows a grammar)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.grammar is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = xgr.allocate_token_bitmask(len(requests), self.compiler.vocab_size)
        bitmask = self._bitmask[:len(requests)]
        masked: list[int] = []
        live: list[_Cursor] = []
        live_rows: list[int] = []
        for row in rows:
            request = requests[row]
            cursor = self._cursor(request)
            if cursor.matcher is None or cursor.broken:
                continue
            masked.append(row)
            if cursor.terminated:
                _allow_only(bitmask, row, request.eos_token_ids)
            else:
                live.append(cursor)
                live_rows.append(row)
        if live:
            self._batch.batch_fill_next_token_bitmask([c.matcher for c in live], bitmask,
                                                      live_rows)
        guard = self.compiler.guard
        for cursor, row in zip(live, live_rows, strict=True):
            if guard is not None and cursor.last_token_id in guard.ends_on_lead:
                bitmask[row] &= guard.after_lead
        return StepMask(bitmask, masked) if masked else None

    def _cursor(self, request: Request) -> _Cursor:
        cursor = self._cursors.get(request)
        if cursor is None:
            grammar = request.sampling_params.grammar
            assert grammar is not None
            try:
                cursor = _Cursor(self.compiler.get(grammar))
            except Exception:  # noqa: BLE001 - the ingress checked the spec: a worker fault
                logger.exception("request %s: its grammar did not compile; its output is not "
                                 "constrained", request.request_id)
                self.compiler.stats.num_failed += 1
                cursor = _Cursor(None)
            self._cursors[request] = cursor
        cursor.catch_up(request)
        return cursor


class PendingMask(Protocol):
    def result(self) -> StepMask | None: ...


class _FillWhenTaken:
    """A mask filled on the engine thread when the sampler takes it."""

    def __init__(self, masks: GrammarMasks, requests: Sequence[Request]) -> None:
        self._masks, self._requests = masks, requests

    def result(self) -> StepMask | None:
        return self._masks.fill(self._requests)


def _allow_only(bitmask: torch.Tensor, index: int, token_ids: Sequence[int]) -> None:
    bitmask[index] = 0
    for token_id in token_ids:
        bit = 1 << (token_id % 32)
        # The words are int32: bit 31 is the sign bit.
        bitmask[index, token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
