"""One reservation on the receiver: what was reserved, what was announced and landed, and the
checks every header and the fence must pass. Pure state: no UCX, no asyncio.

States: reserved -> receiving (BEGIN accepted) -> ready (fence verified) | failed(reason).
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve.engine.kv_layout import KVLayout, LayoutMismatchError
from pdserve.handoff.errors import (
    HandoffDigestError,
    HandoffError,
    HandoffLayoutError,
    HandoffProtocolError,
)
from pdserve.handoff.kvcopy import combine_digests
from pdserve.handoff.piece_plan import PieceSpec
from pdserve.handoff.ticket import FenceInfo
from pdserve.handoff.wire import MAX_PIECES

if TYPE_CHECKING:
    from pdserve.handoff.source_reads import ReadSource


class InboundState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"


@dataclass
class _Piece:
    spec: PieceSpec
    nbytes: int
    digest: int
    landed: bool = False


@dataclass
class InboundTransfer:
    """Receiver-side record of one transfer.

    ``write_lock`` is held by whoever writes into the reserved blocks from Python (staged
    scatter), by whoever starts or ends a direct write (UCX receiving into the blocks, or a
    read copy), and by whoever ends the transfer. Ending it (`finish`) stops new writes; the
    blocks are released (``settled`` set, ``result`` resolved) once no direct write is in
    flight either. Transfers that are read (``source`` set) also take it around every header
    check and landing, which then happen on the read threads as well as on the loop.
    """

    request_id: str
    transfer_id: int
    layout: KVLayout
    block_ids: torch.Tensor  # int64, on the cache's device
    block_id_list: tuple[int, ...]
    num_tokens: int
    deadline: float  # time.monotonic()
    max_piece_bytes: int
    instance: int
    state: InboundState = InboundState.RESERVED
    error: HandoffError | None = None
    session_id: int | None = None
    sender_pid: int | None = None  # from BEGIN; meaningful when the sender is on this host
    fence_info: FenceInfo | None = None
    finished_at: float | None = None
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    result: concurrent.futures.Future[FenceInfo] = field(default_factory=concurrent.futures.Future)
    settled: threading.Event = field(default_factory=threading.Event)
    writes_in_flight: int = 0
    reads_offered: bool = False  # its ticket let a same-host sender offer its cache to read
    source: ReadSource | None = None  # set: the receiver reads the pieces from the sender
    began_in_slot: bool = False  # its sender's read slot announced it before any frame
    _pieces: dict[int, _Piece] = field(default_factory=dict)
    _announced_bytes: int = 0
    _fence: dict[str, Any] | None = None
    _coverage: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._coverage = np.zeros((self.layout.num_local_layers, 2, self.num_blocks), dtype=bool)

    @property
    def num_blocks(self) -> int:
        return len(self.block_id_list)

    @property
    def expected_bytes(self) -> int:
        return self.layout.num_local_layers * self.num_blocks * self.layout.block_bytes

    @property
    def terminal(self) -> bool:
        return self.state in (InboundState.READY, InboundState.FAILED)

    @property
    def slotted(self) -> bool:
        """Pieces and fence are announced in a shared read slot, not by frames."""
        return self.source is not None and self.source.slot is not None

    @property
    def num_landed(self) -> int:
        return sum(piece.landed for piece in list(self._pieces.values()))

    def progress(self) -> str:
        return (f"{self.num_landed}/{len(self._pieces)} announced pieces landed, "
                f"{self._announced_bytes}/{self.expected_bytes} bytes announced, "
                f"fence {'received' if self._fence else 'not received'}")

    # ---- header checks (each raises a HandoffError naming what is wrong) ----------------
    def accept_begin(self, session_id: int, body: dict[str, Any]) -> None:
        """A BEGIN frame; for a transfer this session already began in its read slot, the
        frame must say the same (a contradiction is a protocol error)."""
        again = self.began_in_slot and session_id == self.session_id
        if self.state is not InboundState.RESERVED and not again:
            raise HandoffProtocolError(f"transfer {self.transfer_id} already began or ended")
        if body["instance"] != self.instance:
            raise HandoffProtocolError("ticket names another receiver instance (stale ticket)")
        if body["request_id"] != self.request_id:
            raise HandoffProtocolError(
                f"ticket is for request {self.request_id!r}, sender says {body['request_id']!r}")
        try:
            sender_layout = KVLayout.from_dict(body["layout"])
            self.layout.check_matches(sender_layout)
        except LayoutMismatchError as exc:
            raise HandoffLayoutError(f"refused transfer {self.transfer_id}: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise HandoffLayoutError(
                f"refused transfer {self.transfer_id}: bad layout: {exc}") from exc
        if body["num_blocks"] != self.num_blocks:
            raise HandoffProtocolError(
                f"sender has {body['num_blocks']} blocks, {self.num_blocks} were reserved")
        self.sender_pid = body["pid"]
        if not again:
            self.session_id = session_id
            self.state = InboundState.RECEIVING

    def begin_in_slot(self, session_id: int, source: ReadSource) -> bool:
        """BEGIN and SOURCE at once, from the sender's read slot (checked by the caller
        against the reservation). False unless the transfer is still only reserved."""
        if self.state is not InboundState.RESERVED or not self.reads_offered:
            return False
        self.session_id, self.source, self.began_in_slot = session_id, source, True
        self.state = InboundState.RECEIVING
        return True

    def accept_source(self, session_id: int, source: ReadSource) -> None:
        """The sender offered its cache to read from (same host): before any piece. (A
        transfer that began in its slot is checked by `check_slot_source` instead.)"""
        self._check_sender(session_id, "SOURCE")
        if self.source is not None or self._pieces:
            raise HandoffProtocolError("SOURCE after pieces, or twice")
        self.source = source

    def check_slot_source(self, session_id: int, body: dict[str, Any]) -> None:
        """The SOURCE frame of a transfer that began in its read slot: it must name that
        slot and the same source blocks."""
        feed = self.source.slot if self.source is not None else None
        if session_id != self.session_id or feed is None:
            raise HandoffProtocolError("SOURCE from a session that did not begin this transfer")
        if body["slot"] != feed.slot or body["slot_tag"] != feed.tag:
            raise HandoffProtocolError(
                f"SOURCE names slot {body['slot']}, the transfer began in slot {feed.slot}")
        ids = np.frombuffer(body["blocks"], dtype="<u4")
        if len(ids) != len(self.source.ids) or not np.array_equal(ids, self.source.ids):
            raise HandoffProtocolError("SOURCE lists other blocks than the slot's begin records")

    def accept_piece(self, session_id: int, body: dict[str, Any], read: bool = False,
                     slotted: bool = False) -> PieceSpec:
        """Validate a PIECE header against the reservation; nothing is allocated before this.
        ``read``: the sender says the receiver reads this piece itself (needs a SOURCE);
        ``slotted``: it came from the transfer's read slot (which then must be its only way)."""
        self._check_sender(session_id, "PIECE")
        if read != (self.source is not None):
            raise HandoffProtocolError(
                "piece to be read without a SOURCE" if read else "pushed piece after a SOURCE")
        self._check_channel(slotted, "piece")
        if self._fence is not None:
            raise HandoffProtocolError("piece announced after the fence")
        index, nbytes = body["index"], body["nbytes"]
        if not 0 <= index < MAX_PIECES or index in self._pieces:
            raise HandoffProtocolError(f"piece index {index} is out of range or repeated")
        remaining = self.expected_bytes - self._announced_bytes
        if nbytes > remaining or nbytes > self.max_piece_bytes:
            raise HandoffProtocolError(
                f"piece {index} claims {nbytes} bytes; only {remaining} of the "
                f"{self.expected_bytes} reserved bytes remain (piece bound {self.max_piece_bytes})")
        layers = self._bounds(body["layers"], self.layout.num_local_layers, "layers")
        kvs = self._bounds(body["kv"], 2, "kv")
        blocks = self._bounds(body["blocks"], self.num_blocks, "blocks")
        spec = PieceSpec(index, *layers, *blocks, *kvs)
        if spec.nbytes(self.layout) != nbytes:
            raise HandoffProtocolError(
                f"piece {index} claims {nbytes} bytes, its bounds hold {spec.nbytes(self.layout)}")
        region = self._coverage[spec.layer_start:spec.layer_end, spec.kv_start:spec.kv_end,
                                spec.block_start:spec.block_end]
        if region.any():
            raise HandoffProtocolError(f"piece {index} overlaps KV already announced")
        region[...] = True
        self._pieces[index] = _Piece(spec, nbytes, body["digest"])
        self._announced_bytes += nbytes
        return spec

    def accept_fence(self, session_id: int, body: dict[str, Any], slotted: bool = False) -> None:
        self._check_sender(session_id, "FENCE")
        self._check_channel(slotted, "fence")
        if self._fence is not None:
            raise HandoffProtocolError("second fence")
        problems = []
        if body["num_pieces"] != len(self._pieces):
            problems.append(
                f"fence counts {body['num_pieces']} pieces, {len(self._pieces)} announced")
        if body["nbytes"] != self._announced_bytes or body["nbytes"] != self.expected_bytes:
            problems.append(
                f"fence counts {body['nbytes']} bytes, {self._announced_bytes} announced, "
                f"{self.expected_bytes} reserved")
        if not self._coverage.all():
            problems.append(
                f"{int((~self._coverage).sum())} (layer, K/V, block) slots never announced")
        if body["num_tokens"] != self.num_tokens:
            problems.append(f"fence covers {body['num_tokens']} tokens, {self.num_tokens} reserved")
        if body["first_token_id"] < 0:
            problems.append(f"first token id {body['first_token_id']} is negative")
        records = [(p.spec, p.nbytes, p.digest) for p in self._pieces.values()]
        if not problems and combine_digests(records) != body["digest"]:
            problems.append("fence digest does not match the announced pieces")
        if problems:
            raise HandoffProtocolError("fence rejected: " + "; ".join(problems))
        self._fence = body

    def piece_digest(self, index: int) -> int:
        return self._pieces[index].digest

    def digest_error(self, spec: PieceSpec, actual: int) -> HandoffDigestError:
        return HandoffDigestError(
            f"piece {spec.index} (layers {spec.layer_start}-{spec.layer_end - 1}) of "
            f"{self.request_id!r} hashes to {actual:#x}, its header said "
            f"{self.piece_digest(spec.index):#x}")

    def mark_landed(self, index: int) -> None:
        self._pieces[index].landed = True

    def completion(self) -> FenceInfo | None:
        """The fence outcome once the fence verified and every announced piece landed."""
        if self._fence is None or not all(p.landed for p in list(self._pieces.values())):
            return None
        return FenceInfo(self.request_id, self._fence["first_token_id"], self.num_tokens,
                         self._announced_bytes, len(self._pieces))

    def finish(self, error: HandoffError | None, now: float) -> bool:
        """End the transfer: ready (``error`` None, fence verified) or failed. The caller holds
        ``write_lock``. Returns False when it had already ended (the first outcome stands).
        Call `settle` once ``writes_in_flight`` is zero."""
        if self.terminal:
            return False
        self.finished_at = now
        if error is None:
            info = self.completion()
            if info is None:
                raise RuntimeError("finish() before the fence verified and all pieces landed")
            self.state, self.fence_info = InboundState.READY, info
        else:
            self.state, self.error = InboundState.FAILED, error
        return True

    def begin_direct_write(self) -> bool:
        """Caller holds ``write_lock``: False once the transfer ended (write nothing)."""
        if self.terminal:
            return False
        self.writes_in_flight += 1
        return True

    def end_direct_write(self) -> bool:
        """Caller holds ``write_lock``: True when this was the last write of an ended
        transfer, i.e. the caller must `settle` it now."""
        self.writes_in_flight -= 1
        return self.terminal and self.writes_in_flight == 0

    def settle(self) -> None:
        """Publish the outcome: nothing writes into the blocks any more. Once, after the
        transfer ended and its last direct write did."""
        if self.settled.is_set():
            return
        if self.error is None:
            assert self.fence_info is not None
            self.result.set_result(self.fence_info)
        else:
            self.result.set_exception(self.error)
        self.settled.set()

    def _check_channel(self, slotted: bool, what: str) -> None:
        if slotted != self.slotted:
            raise HandoffProtocolError(
                f"{what} in a read slot the SOURCE did not name" if slotted else
                f"{what} frame for a transfer announced through its read slot")

    def _check_sender(self, session_id: int, what: str) -> None:
        if self.state is not InboundState.RECEIVING:
            raise HandoffProtocolError(f"{what} for a transfer in state {self.state.value}")
        if session_id != self.session_id:
            raise HandoffProtocolError(f"{what} from a session that did not begin this transfer")

    @staticmethod
    def _bounds(value: Any, limit: int, name: str) -> tuple[int, int]:
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
        if not ok or not 0 <= value[0] < value[1] <= limit:
            raise HandoffProtocolError(f"piece {name} {value!r} outside [0, {limit})")
        return value[0], value[1]
