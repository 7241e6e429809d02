"""The records that cross component boundaries: the ticket (decode -> router -> prefill),
the fence outcome a ready transfer resolves with, and the sender's completion result.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pdserve.engine.kv.layout import KVLayout, KVSlice, check_known_fields

PROTOCOL_VERSION = 5


@dataclass(frozen=True)
class HandoffTicket:
    """What a prefill worker needs to push one request's KV into a decode worker's blocks.

    Made by `HandoffReceiver.reserve`; travels as ``to_dict()`` (msgpack-able: str, int, float,
    bytes and a layout dict) through the router. It grants nothing by itself: the sender must
    also authenticate with the cluster token, and the receiver checks every message against
    the reservation this ticket names.

    - ``receiver_address``: the receiver's UCX worker address (opaque bytes).
    - ``receiver_instance``: random id of the receiver's transport; a restarted receiver has
      another one, so a stale ticket is refused instead of landing in someone else's blocks.
    - ``receiver_host``: host identity (boot id + hostname); the sender's endpoint to an
      equal host runs without UCX error handling, so UCX may use shared memory.
    - ``transfer_id``: 32-bit id, unique among the receiver's live and recent transfers, part
      of every data tag of this transfer.
    - ``max_piece_bytes``: the largest piece the receiver will stage; the sender plans under it.
    - ``deadline``: absolute ``time.time()`` after which both sides give the transfer up.
    - ``layout``, ``kv_heads``: the receiving cache's layout and which of its KV heads (the
      model's numbering) this transfer fills: all of them (None), or the part one rank of
      the sender's TP group holds.
    """

    request_id: str
    transfer_id: int
    receiver_address: bytes
    receiver_instance: int
    receiver_host: str
    num_blocks: int
    num_tokens: int
    expected_bytes: int
    max_piece_bytes: int
    deadline: float
    layout: KVLayout
    kv_heads: tuple[int, int] | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.layout.kv_heads)
        if not 0 < self.transfer_id < 1 << 32:
            raise ValueError(f"HandoffTicket.transfer_id {self.transfer_id} outside (0, 2**32)")
        if self.num_blocks <= 0 or self.num_tokens <= 0:
            raise ValueError("HandoffTicket needs a positive num_blocks and num_tokens")
        if self.num_tokens > self.num_blocks * self.layout.block_size:
            raise ValueError(
                f"HandoffTicket: {self.num_tokens} tokens do not fit {self.num_blocks} blocks "
                f"of {self.layout.block_size}"
            )
        expected = self.kv.num_local_layers * self.num_blocks * self.kv.block_bytes
        if self.expected_bytes != expected:
            raise ValueError(f"HandoffTicket.expected_bytes {self.expected_bytes} != {expected}")
        if self.protocol_version != PROTOCOL_VERSION:
            raise ValueError(
                f"HandoffTicket protocol version {self.protocol_version} unsupported "
                f"(this build speaks {PROTOCOL_VERSION})"
            )

    @property
    def kv(self) -> KVSlice:
        """The reserved cache's heads this transfer fills (raises ValueError outside it)."""
        assert self.kv_heads is not None
        return KVSlice(self.layout, self.kv_heads)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["layout"] = self.layout.to_dict()
        data["kv_heads"] = list(self.kv.heads)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HandoffTicket:
        check_known_fields(cls, data)
        values = dict(data)
        layout = values.get("layout")
        if not isinstance(layout, dict):
            raise TypeError("HandoffTicket.layout must be a dict (KVLayout.to_dict())")
        values["layout"] = KVLayout.from_dict(layout)
        heads = values.get("kv_heads")
        if heads is not None:
            if (not isinstance(heads, (list, tuple)) or len(heads) != 2
                    or not all(isinstance(h, int) and not isinstance(h, bool) for h in heads)):
                raise TypeError(f"HandoffTicket.kv_heads must be two ints, got {heads!r}")
            values["kv_heads"] = (heads[0], heads[1])
        for name, kind in (("transfer_id", int), ("receiver_instance", int), ("num_blocks", int),
                           ("num_tokens", int), ("expected_bytes", int), ("max_piece_bytes", int)):
            if not isinstance(values.get(name), kind) or isinstance(values.get(name), bool):
                raise TypeError(f"HandoffTicket.{name} must be an int, got {values.get(name)!r}")
        if not isinstance(values.get("receiver_address"), (bytes, bytearray)):
            raise TypeError("HandoffTicket.receiver_address must be bytes")
        values["receiver_address"] = bytes(values["receiver_address"])
        if not isinstance(values.get("deadline"), (int, float)):
            raise TypeError(f"HandoffTicket.deadline must be a number, got "
                            f"{values.get('deadline')!r}")
        values["deadline"] = float(values["deadline"])
        for name in ("request_id", "receiver_host"):
            if not isinstance(values.get(name), str):
                raise TypeError(f"HandoffTicket.{name} must be a str")
        return cls(**values)


@dataclass(frozen=True)
class FenceInfo:
    """What a verified fence tells decode: the first sampled token and the KV it covers."""

    request_id: str
    first_token_id: int
    num_tokens: int
    num_bytes: int
    num_pieces: int


@dataclass(frozen=True)
class SendResult:
    """How one outbound transfer ended, once no send of it is in flight any more.

    When the sender resolves this, no send of the transfer reads any of its memory any more:
    the prefill worker may free or cache the source blocks. ``error`` is None on success.
    """

    request_id: str
    transfer_id: int
    num_bytes_sent: int
    num_pieces_sent: int
    error: Exception | None
    released_at: float  # time.monotonic() when the result was set

    @property
    def ok(self) -> bool:
        return self.error is None
