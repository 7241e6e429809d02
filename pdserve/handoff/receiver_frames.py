"""Decode side: the frames a sender session sends (BEGIN, SOURCE, PIECE, FENCE, ABORT,
PING), authenticated, checked against their reservation and routed to landing or reading.
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
from pdserve.handoff.piece_plan import PieceSpec
from pdserve.handoff.read_copier import ReadCopier
from pdserve.handoff.sessions import SenderSession, SessionTable
from pdserve.handoff.source_reads import SourceMaps
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
FailFn = Callable[[InboundTransfer, HandoffError, "SenderSession | None"], None]
FinishFn = Callable[[InboundTransfer, "HandoffError | None"], bool]
RecordFn = Callable[[InboundTransfer], None]
# Receiver-side frame kinds (the transport routes these to `ReceiverFrames.on_frame`).
RECEIVER_KINDS = (Kind.HELLO, Kind.PROOF, Kind.BEGIN, Kind.SOURCE, Kind.PIECE, Kind.FENCE,
                  Kind.ABORT_TO_RECEIVER, Kind.PING)


class ReceiverFrames:
    """Routes a receiver's frames, on the loop thread. A bad header fails its transfer (the
    sender is told) and a piece for no live transfer is drained; counts go into ``counts``
    ("rejected" frames, "slotted" transfers)."""

    def __init__(self, sessions: SessionTable, sources: SourceMaps, landing: PieceLanding,
                 copier: ReadCopier, host: str, lookup: Callable[[int], InboundTransfer | None],
                 outcomes: tuple[FailFn, FinishFn, RecordFn], counts: dict[str, int]) -> None:
        self._sessions, self._sources, self._host = sessions, sources, host
        self._landing, self._copier, self._lookup = landing, copier, lookup
        self._fail, self._finish, self._maybe_ready = outcomes
        self._counts = counts

    def on_frame(self, kind: Kind, raw: bytes) -> None:
        """Loop thread: one frame of a receiver-side kind, authenticated, then routed."""
        try:
            if kind is Kind.HELLO:
                return self._sessions.on_hello(raw)
            if kind is Kind.PROOF:
                return self._sessions.on_proof(raw)
            frame, session = self._sessions.authenticate(raw, peek(raw)[1])
        except WireError as exc:
            self._counts["rejected"] += 1  # loop only
            log.warning("rejected a %s frame: %s", kind.name, exc)
            return None
        if kind is Kind.PING:
            self._sessions.send(session, Kind.PONG, {"seq": frame.body["seq"]})
            return None
        record = self._lookup(frame.body["tid"])
        if kind is Kind.BEGIN:
            self._on_begin(record, frame, session)
        elif kind is Kind.SOURCE and record is not None and not record.terminal:
            self._on_source(record, frame, session)
        elif kind is Kind.PIECE:
            self._on_pieces(record, frame, session)
        elif kind is Kind.FENCE and record is not None and not record.terminal:
            try:
                with record.write_lock:  # read threads may be landing pieces
                    record.accept_fence(session.session_id, frame.body)
            except HandoffError as exc:
                return self._fail(record, exc, session)
            self._maybe_ready(record)
        elif (kind is Kind.ABORT_TO_RECEIVER and record is not None and not record.terminal
              and record.session_id == session.session_id):
            cause = error_from_code(frame.body["code"], frame.body["message"])
            self._finish(record, type(cause)(f"sender aborted: {cause}"))
        return None

    def _on_begin(self, record: InboundTransfer | None, frame: Frame,
                  session: SenderSession) -> None:
        tid = frame.body["tid"]
        if (record is not None and record.terminal and record.began_in_slot
                and record.session_id == session.session_id):
            return  # it began and ended through its slot before this frame arrived
        if record is None or record.terminal:
            reason = (record.error if record is not None and record.error is not None
                      else HandoffUnknownTransferError(f"no live reservation for transfer {tid}"))
            self._sessions.send(session, Kind.ABORT_TO_SENDER,
                                {"tid": tid, "code": reason.code, "message": str(reason)})
            return
        try:
            with record.write_lock:  # its slot watcher may be starting it meanwhile
                record.accept_begin(session.session_id, frame.body)
        except HandoffError as exc:
            self._fail(record, exc, session)
            return
        if session.host != self._host:
            record.sender_pid = None  # another host's pid says nothing here

    def _on_source(self, record: InboundTransfer, frame: Frame, session: SenderSession) -> None:
        if record.began_in_slot:
            try:
                with record.write_lock:
                    record.check_slot_source(session.session_id, frame.body)
            except HandoffError as exc:
                self._fail(record, exc, session)
            return
        try:
            source = self._sources.source_for(session, record, frame.body)
            with record.write_lock:
                record.accept_source(session.session_id, source)
            if source.slot is not None:
                self._sources.follow(session, record, source.slot)
                self._counts["slotted"] += 1  # loop only
        except HandoffError as exc:
            self._fail(record, exc, session)

    def _on_pieces(self, record: InboundTransfer | None, frame: Frame,
                   session: SenderSession) -> None:
        entries = frame.body["pieces"]
        if len(entries) > PIECES_PER_FRAME:
            if record is not None:
                self._fail(record, HandoffProtocolError(
                    f"{len(entries)} pieces in one frame (at most {PIECES_PER_FRAME})"), session)
            return
        to_read = []
        for entry in entries:
            try:
                header = piece_header(entry)
            except WireError as exc:
                if record is not None:
                    self._fail(record, HandoffProtocolError(str(exc)), session)
                return
            spec = self._on_piece(record, frame.body["tid"], header, session, frame.body["read"])
            if spec is not None:
                to_read.append(spec)
        for spec in to_read if record is not None else ():
            self._copier.submit(record, spec)

    def _on_piece(self, record: InboundTransfer | None, tid: int, header: dict[str, Any],
                  session: SenderSession, read: bool) -> PieceSpec | None:
        """Check one announced piece; a pushed one is received (or drained) right away, a
        piece to read is returned for the caller to read with the rest of its frame."""
        index = header["index"]
        if not 0 <= index < MAX_PIECES:
            if record is not None:
                error = HandoffProtocolError(f"piece index {index} out of range")
                self._fail(record, error, session)
            return None
        tag = data_tag(tid, index)
        if record is None or record.terminal:
            if not read:  # a read piece has no payload to drain
                self._landing.drain(tid, tag)
            return None
        try:
            if read:  # read threads may be landing this transfer's pieces meanwhile
                with record.write_lock:
                    spec = record.accept_piece(session.session_id, header, read)
            else:
                spec = record.accept_piece(session.session_id, header, read)
        except HandoffError as exc:
            self._fail(record, exc, session)
            if not read:
                self._landing.drain(tid, tag)
            return None
        if read:
            return spec
        self._landing.receive(record, spec, tag)
        return None
