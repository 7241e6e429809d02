"""Faults the test agents inject from outside the handoff (nothing in pdserve knows of them):
wrappers around the transport's payload primitives and the sender's frame sends, installed
process-wide in an agent and removed again when its roles are rebuilt.

- ``corrupt_piece``: flip one byte of that piece's payload on its way out (after its digest
  was taken): what a bit flip on the wire looks like.
- ``inflate_piece_bytes``: announce that many extra bytes in piece 0's header (a lying sender).
- ``pad_piece_bytes``: send that many bytes more than piece 0's header announced.
- ``recv_delay_s``: wait that long before posting each piece's receive (a slow receiver); the
  sender's rendezvous sends stay in flight meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from pdserve.handoff.peers import PeerLink
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import Kind

_ORIGINALS = {"send_payload": HandoffTransport.send_payload,
              "recv_payload": HandoffTransport.recv_payload, "send": PeerLink.send}


def clear_faults() -> None:
    HandoffTransport.send_payload = _ORIGINALS["send_payload"]  # type: ignore[method-assign]
    HandoffTransport.recv_payload = _ORIGINALS["recv_payload"]  # type: ignore[method-assign]
    PeerLink.send = _ORIGINALS["send"]  # type: ignore[method-assign]


def install_sender_faults(corrupt_piece: int | None = None, inflate_piece_bytes: int = 0,
                          pad_piece_bytes: int = 0) -> None:
    send_payload, send = _ORIGINALS["send_payload"], _ORIGINALS["send"]

    async def faulty_payload(transport: HandoffTransport, endpoint: Any, buffer: torch.Tensor,
                             tag: int) -> None:
        index = tag & 0xFFFF
        if index == corrupt_piece:
            buffer = buffer.clone()
            buffer[buffer.numel() // 2] ^= 0xFF
        if index == 0 and pad_piece_bytes:
            buffer = torch.cat([buffer, torch.zeros(pad_piece_bytes, dtype=buffer.dtype)])
        await send_payload(transport, endpoint, buffer, tag)

    def lying_send(link: PeerLink, kind: Kind, body: dict[str, Any], **kwargs: Any) -> Any:
        if kind is Kind.PIECE and inflate_piece_bytes:
            entries = [list(entry) for entry in body["pieces"]]
            for entry in entries:
                if entry[0] == 0:
                    entry[7] += inflate_piece_bytes
            body = {**body, "pieces": entries}
        return send(link, kind, body, **kwargs)

    HandoffTransport.send_payload = faulty_payload  # type: ignore[method-assign]
    PeerLink.send = lying_send  # type: ignore[method-assign]


def install_receiver_faults(recv_delay_s: float = 0.0) -> None:
    recv_payload = _ORIGINALS["recv_payload"]

    async def slow_receive(transport: HandoffTransport, endpoint: Any, buffer: torch.Tensor,
                           tag: int) -> None:
        await asyncio.sleep(recv_delay_s)
        await recv_payload(transport, endpoint, buffer, tag)

    if recv_delay_s:
        HandoffTransport.recv_payload = slow_receive  # type: ignore[method-assign]
