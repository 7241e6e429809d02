"""Decode side: the frames a sender session sends (BEGIN, PIECE, FENCE, ABORT, PING),
authenticated, checked against their reservation and routed to landing. Loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pdserve.handoff.errors import (
    HandoffError,
    HandoffProtocolError,
    HandoffUnknownTransferError,
    error_from_code,
)
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.landing import PieceLanding
from pdserve.handoff.sessions import SenderSession, SessionTable
from pdserve.handoff.wire import (
    MAX_PIECES,
    PIECES_PER_FRAME,
    Frame,
    Kind,
    WireError,
    data_tag,
    peek,
    piece_header,
)

log = logging.getLogger(__name__)
FailFn = Callable[[InboundTransfer, HandoffError], None]
FinishFn = Callable[[InboundTransfer, "HandoffError | None"], bool]
RecordFn = Callable[[InboundTransfer], None]
# Receiver-side frame kinds (the transport routes these to `ReceiverFrames.on_frame`).
RECEIVER_KINDS = (Kind.HELLO, Kind.PROOF, Kind.BEGIN, Kind.PIECE, Kind.FENCE,
                  Kind.ABORT_TO_RECEIVER, Kind.PING)


class ReceiverFrames:
    """Routes a receiver's frames. A bad header fails its transfer (the sender is told) and a
    piece for no live transfer is drained; rejected frames are counted in ``counts``."""

    def __init__(self, sessions: SessionTable, landing: PieceLanding,
                 lookup: Callable[[int], InboundTransfer | None], fail: FailFn,
                 finish: FinishFn, maybe_ready: RecordFn, counts: dict[str, int]) -> None:
        self._sessions, self._landing, self._lookup = sessions, landing, lookup
        self._fail, self._finish, self._maybe_ready = fail, finish, maybe_ready
        self._counts = counts

    def on_frame(self, kind: Kind, raw: bytes) -> None:
        """One frame of a receiver-side kind, authenticated, then routed."""
        try:
            if kind is Kind.HELLO:
                return self._sessions.on_hello(raw)
            if kind is Kind.PROOF:
                return self._sessions.on_proof(raw)
            frame, session = self._sessions.authenticate(raw, peek(raw)[1])
        except WireError as exc:
            self._counts["rejected"] += 1
            log.warning("rejected a %s frame: %s", kind.name, exc)
            return None
        if kind is Kind.PING:
            self._sessions.send(session, Kind.PONG, {"seq": frame.body["seq"]})
            return None
        record = self._lookup(frame.body["tid"])
        if kind is Kind.BEGIN:
            self._on_begin(record, frame, session)
        elif kind is Kind.PIECE:
            self._on_pieces(record, frame, session)
        elif kind is Kind.FENCE and record is not None and not record.terminal:
            try:
                record.accept_fence(session.session_id, frame.body)
            except HandoffError as exc:
                return self._fail(record, exc)
            self._maybe_ready(record)
        elif (kind is Kind.ABORT_TO_RECEIVER and record is not None and not record.terminal
              and record.session_id == session.session_id):
            cause = error_from_code(frame.body["code"], frame.body["message"])
            self._finish(record, type(cause)(f"sender aborted: {cause}"))
        return None

    def _on_begin(self, record: InboundTransfer | None, frame: Frame,
                  session: SenderSession) -> None:
        tid = frame.body["tid"]
        if record is None or record.terminal:
            reason = (record.error if record is not None and record.error is not None
                      else HandoffUnknownTransferError(f"no live reservation for transfer {tid}"))
            self._sessions.send(session, Kind.ABORT_TO_SENDER,
                                {"tid": tid, "code": reason.code, "message": str(reason)})
            return
        try:
            record.accept_begin(session.session_id, frame.body)
        except HandoffError as exc:
            self._fail(record, exc)
            if record.session_id is None:  # refused before it began: tell this sender
                self._sessions.send(session, Kind.ABORT_TO_SENDER,
                                    {"tid": tid, "code": exc.code, "message": str(exc)})

    def _on_pieces(self, record: InboundTransfer | None, frame: Frame,
                   session: SenderSession) -> None:
        entries = frame.body["pieces"]
        if len(entries) > PIECES_PER_FRAME:
            if record is not None:
                self._fail(record, HandoffProtocolError(
                    f"{len(entries)} pieces in one frame (at most {PIECES_PER_FRAME})"))
            return
        for entry in entries:
            try:
                header = piece_header(entry)
            except WireError as exc:
                if record is not None:
                    self._fail(record, HandoffProtocolError(str(exc)))
                return
            self._on_piece(record, frame.body["tid"], header, session)

    def _on_piece(self, record: InboundTransfer | None, tid: int, header: dict[str, Any],
                  session: SenderSession) -> None:
        """Check one announced piece; receive it (or drain it) right away."""
        index = header["index"]
        if not 0 <= index < MAX_PIECES or not 0 < tid < 1 << 32:
            if record is not None:
                self._fail(record, HandoffProtocolError(f"piece index {index} out of range"))
            return
        tag = data_tag(tid, index)
        if record is None or record.terminal or record.session_id != session.session_id:
            self._landing.drain(tid, tag, session.endpoint)
            return
        try:
            spec = record.accept_piece(session.session_id, header)
        except HandoffError as exc:
            self._fail(record, exc)
            self._landing.drain(tid, tag, session.endpoint)
            return
        self._landing.receive(record, spec, tag, session.endpoint)
