"""Receiver side of peer authentication: the senders that said HELLO, the challenge each got,
their session keys once proven, and the endpoint back to each (replies, and the receives of
their pieces). Loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve import auth
from pdserve.handoff.liveness import why_gone
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import Frame, Kind, WireError, decode, encode

log = logging.getLogger(__name__)
MAX_PENDING_HANDSHAKES = 64


@dataclass
class SenderSession:
    session_id: int
    host: str
    sender_nonce: bytes
    receiver_nonce: bytes
    last_seen: float
    endpoint: asyncio.Future[Any] = field(repr=False)
    pid: int | None = None  # set when the sender is a process we can see
    key: bytes | None = None



class SessionTable:
    """Sessions by id. A session is usable (its frames decode) only after a valid PROOF.
    ``on_error(session_id)`` runs when UCX reports the endpoint to a sender failed."""

    def __init__(self, transport: HandoffTransport, on_error: Callable[[int], None]) -> None:
        self._transport = transport
        self._on_error = on_error
        self._token = transport.config.auth_token
        self._sessions: dict[int, SenderSession] = {}
        self.num_refused = 0

    def get(self, session_id: int | None) -> SenderSession | None:
        return None if session_id is None else self._sessions.get(session_id)

    def on_hello(self, raw: bytes) -> None:
        frame = decode(raw, key=None)
        if frame.session_id in self._sessions:
            return  # a duplicate HELLO changes nothing
        self._evict_pending()
        loop = self._transport.loop
        body = frame.body
        session = SenderSession(frame.session_id, body["host"], body["nonce"], auth.new_nonce(),
                                time.monotonic(), loop.create_future(),
                                body["pid"] if body["scope"] == self._transport.scope else None)
        self._sessions[session.session_id] = session
        self._transport.spawn(self._connect(session, frame.body["address"]))
        self.send(session, Kind.CHALLENGE,
                  {"nonce": session.receiver_nonce, "instance": self._transport.instance_id})

    async def _connect(self, session: SenderSession, address: bytes) -> None:
        try:
            endpoint = await self._transport.open_endpoint(
                address, session.host, lambda: self._on_error(session.session_id))
        except Exception as exc:  # noqa: BLE001 - an unreachable peer only loses its session
            log.warning("cannot reach sender session %x: %s", session.session_id, exc)
            self._sessions.pop(session.session_id, None)
            if not session.endpoint.done():
                session.endpoint.set_exception(exc)
                session.endpoint.exception()  # mark retrieved: nobody may be waiting
            return
        if session.endpoint.done():  # dropped while connecting
            self._transport.close_endpoint(endpoint)
        else:
            session.endpoint.set_result(endpoint)

    def on_proof(self, raw: bytes) -> None:
        frame = decode(raw, key=None)
        session = self._sessions.get(frame.session_id)
        if session is None or session.key is not None:
            return
        if auth.check_proof(self._token, session.session_id, session.sender_nonce,
                            session.receiver_nonce, frame.body["proof"]):
            session.key = auth.session_key(self._token, session.session_id, session.sender_nonce,
                                           session.receiver_nonce)
            session.last_seen = time.monotonic()
            t = self._transport
            self.send(session, Kind.WELCOME,
                      {"instance": t.instance_id, "scope": t.scope, "pid": t.pid})
            return
        self.num_refused += 1
        log.warning("refused handoff peer (session %x, host %s): wrong cluster token",
                    session.session_id, session.host)
        sent = self.send(session, Kind.REFUSED, {"reason": "peer did not prove the cluster token"})
        sent.add_done_callback(lambda _: self.drop(session.session_id))

    def authenticate(self, raw: bytes, session_id: int) -> tuple[Frame, SenderSession]:
        """Decode a MAC'd frame of an authenticated session (WireError otherwise)."""
        session = self._sessions.get(session_id)
        if session is None or session.key is None:
            raise WireError(f"frame from unknown or unauthenticated session {session_id:x}")
        frame = decode(raw, key=session.key)
        session.last_seen = time.monotonic()
        return frame, session

    def send(self, session: SenderSession, kind: Kind, body: dict[str, Any]) -> asyncio.Task[None]:
        frame = encode(kind, session.session_id, body, session.key)
        return self._transport.spawn(self._send(session, frame, kind))

    async def _send(self, session: SenderSession, frame: bytes, kind: Kind) -> None:
        try:
            endpoint = await session.endpoint
            await self._transport.send_frame(endpoint, frame)
        except Exception as exc:  # noqa: BLE001 - replies are best effort; deadlines cover loss
            log.warning("could not send %s to session %x: %s", kind.name, session.session_id, exc)

    def gone(self, now: float, timeout: float) -> dict[int, str]:
        """Sessions whose sender is gone (`why_gone`), with the reason."""
        reasons = {s.session_id: why_gone(s.pid, s.last_seen, now, timeout)
                   for s in self._sessions.values()}
        return {sid: why for sid, why in reasons.items() if why is not None}

    def drop(self, session_id: int) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        if session.endpoint.done() and session.endpoint.exception() is None:
            self._transport.close_endpoint(session.endpoint.result())
        elif not session.endpoint.done():
            session.endpoint.cancel()

    def _evict_pending(self) -> None:
        pending = [s for s in self._sessions.values() if s.key is None]
        if len(pending) >= MAX_PENDING_HANDSHAKES:
            oldest = min(pending, key=lambda s: s.last_seen)
            self.drop(oldest.session_id)
