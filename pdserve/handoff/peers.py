"""Sender side of a connection to one receiver worker: endpoint, authentication handshake,
session key, heartbeats, liveness. One `PeerLink` per receiver address, shared by all
transfers to it; a restarted receiver has a new address, so it gets a new link.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from pdserve import auth
from pdserve.handoff.errors import (
    HandoffAuthError,
    HandoffCancelledError,
    HandoffError,
    HandoffPeerGoneError,
)
from pdserve.handoff.liveness import why_gone
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import Frame, Kind, decode, encode

log = logging.getLogger(__name__)


class PeerLink:
    """Loop only. ``ready`` resolves once the receiver accepted our proof of the cluster token
    (and proved it too: its WELCOME carries the session MAC), or raises a `HandoffError`.
    ``on_down(link)`` runs once, on the loop, when the link fails for any reason."""

    def __init__(self, transport: HandoffTransport, address: bytes, host: str,
                 on_down: Callable[[PeerLink], None]) -> None:
        self._transport = transport
        self._on_down = on_down
        self.address, self.host = address, host
        self.session_id = int.from_bytes(os.urandom(8), "little") >> 1
        self._nonce = auth.new_nonce()
        self._key: bytes | None = None
        self.ready: asyncio.Future[None] = transport.loop.create_future()
        self.endpoint: Any = None
        self.last_heard = time.monotonic()
        self.dead: HandoffError | None = None
        self.peer_pid: int | None = None  # set when the receiver is a process we can see
        self.transfers: set[Any] = set()
        self._frame_sends: set[asyncio.Task[None]] = set()
        self._ping_seq = 0
        self._connector = transport.spawn(self._connect())

    async def _connect(self) -> None:
        timeout = self._transport.config.handshake_timeout_s
        try:
            self.endpoint = await self._transport.open_endpoint(
                self.address, self.host, lambda: self.fail(HandoffPeerGoneError(
                    "UCX reports the receiver's endpoint failed")))
            t = self._transport
            hello = {"address": t.address, "nonce": self._nonce, "host": t.host,
                     "scope": t.scope, "pid": t.pid}
            await self._send_raw(encode(Kind.HELLO, self.session_id, hello, None))
            await asyncio.wait_for(asyncio.shield(self.ready), timeout)
        except TimeoutError:
            self.fail(HandoffPeerGoneError(
                f"receiver did not answer the handshake within {timeout}s"))
        except HandoffError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - UCX could not reach the address
            self.fail(HandoffPeerGoneError(f"cannot reach receiver: {exc}"))

    # ---- frames from the receiver -----------------------------------------------------
    def on_frame(self, kind: Kind, raw: bytes) -> Frame | None:
        """Handle handshake/heartbeat frames; return authenticated frames for the sender."""
        if self.dead is not None:
            return None
        if kind is Kind.CHALLENGE:
            frame = decode(raw, key=None)
            if self._key is None:
                nonce = frame.body["nonce"]
                token = self._transport.config.auth_token
                self._key = auth.session_key(token, self.session_id, self._nonce, nonce)
                proof = auth.proof(token, self.session_id, self._nonce, nonce)
                self.send(Kind.PROOF, {"proof": proof}, signed=False)
            return None
        if kind is Kind.REFUSED:
            reason = decode(raw, key=None).body["reason"]
            self.fail(HandoffAuthError(f"receiver refused this sender: {reason}"))
            return None
        if self._key is None:
            return None
        frame = decode(raw, key=self._key)  # raises WireError on a bad MAC
        self.last_heard = time.monotonic()
        if kind is Kind.WELCOME and not self.ready.done():
            if frame.body["scope"] == self._transport.scope:
                self.peer_pid = frame.body["pid"]
            self.ready.set_result(None)
            return None
        return None if kind is Kind.PONG else frame

    # ---- sending ----------------------------------------------------------------------------
    def send(self, kind: Kind, body: dict[str, Any], *, signed: bool = True) -> asyncio.Task[None]:
        """Queue one control frame (posted in call order; UCX keeps that order)."""
        frame = encode(kind, self.session_id, body, self._key if signed else None)
        task = self._transport.spawn(self._send_raw(frame))
        self._frame_sends.add(task)
        task.add_done_callback(self._frame_sends.discard)
        return task

    async def _send_raw(self, frame: bytes) -> None:
        try:
            await self._transport.send_frame(self.endpoint, frame)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a frame that cannot leave means the peer is gone
            self.fail(HandoffPeerGoneError(f"control frame to the receiver failed: {exc}"))

    def ping_if_due(self, now: float) -> None:
        """Heartbeat, idle or not: the receiver forgets sessions that fall silent (its sender
        may have died), and a pooled link must still work for the next transfer. Declares
        the peer gone at once when its process (on this machine) exited, else after
        peer_timeout_s without an answer."""
        if self.dead is not None or not self.ready.done():
            return
        why = why_gone(self.peer_pid, self.last_heard, now, self._transport.config.peer_timeout_s)
        if why is not None:
            self.fail(HandoffPeerGoneError(f"receiver gone: {why}"))
            return
        self._ping_seq += 1
        self.send(Kind.PING, {"seq": self._ping_seq})

    def fail(self, error: HandoffError) -> None:
        """The link is unusable: stop its frame sends and close the endpoint. The sender fails
        the transfers that use it."""
        if self.dead is not None:
            return
        self.dead = error
        level = logging.INFO if isinstance(error, HandoffCancelledError) else logging.WARNING
        log.log(level, "handoff link to %s (session %x) down: %s", self.host, self.session_id,
                error)
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # retrieved: transfers may not be waiting yet
        for task in list(self._frame_sends):
            task.cancel()
        if self._connector is not asyncio.current_task():
            self._connector.cancel()
        if self.endpoint is not None:
            self._transport.close_endpoint(self.endpoint)
        self._on_down(self)
