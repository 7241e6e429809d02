"""One reservation on the receiver: what was reserved, what was announced and landed, and the
checks every header and the fence must pass. Pure state: no UCX, no asyncio.

States: reserved -> receiving (BEGIN accepted) -> ready (fence verified) | failed(reason).
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.engine.kv.layout import KVLayout, KVSlice, LayoutMismatchError
from pdserve.handoff.digest import combine_digests
from pdserve.handoff.errors import (
    HandoffDigestError,
    HandoffError,
    HandoffLayoutError,
    HandoffProtocolError,
)
from pdserve.handoff.plan import PieceSpec
from pdserve.handoff.ticket import FenceInfo
from pdserve.handoff.wire import MAX_PIECES


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

    ``write_lock`` is held by whoever writes into the reserved blocks (a piece's scatter out of
    staging) and by whoever ends the transfer, so once `finish` returned nothing writes into
    them again: a scatter checks `terminal` under the lock first. ``result`` resolves (via
    `publish`, outside the lock) right after.
    """

    request_id: str
    transfer_id: int
    kv: KVSlice  # the reserved cache's layout, and the KV heads this transfer fills
    block_ids: torch.Tensor  # int64, on the host (built on the caller's loop: no device copy)
    block_id_list: tuple[int, ...]
    num_tokens: int
    deadline: float  # time.monotonic()
    max_piece_bytes: int
    instance: int
    digest_kind: str
    state: InboundState = InboundState.RESERVED
    error: HandoffError | None = None
    session_id: int | None = None
    fence_info: FenceInfo | None = None
    finished_at: float | None = None
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    device_block_ids: torch.Tensor | None = None  # block_ids where the cache is (payload thread)
    result: concurrent.futures.Future[FenceInfo] = field(default_factory=concurrent.futures.Future)
    _pieces: dict[int, _Piece] = field(default_factory=dict)
    _announced_bytes: int = 0
    _fence: dict[str, Any] | None = None
    _coverage: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._coverage = np.zeros((self.kv.num_local_layers, 2, self.num_blocks), dtype=bool)

    @property
    def num_blocks(self) -> int:
        return len(self.block_id_list)

    @property
    def expected_bytes(self) -> int:
        return self.kv.num_local_layers * self.num_blocks * self.kv.block_bytes

    @property
    def terminal(self) -> bool:
        return self.state in (InboundState.READY, InboundState.FAILED)

    def progress(self) -> str:
        landed = sum(piece.landed for piece in list(self._pieces.values()))
        return (f"{landed}/{len(self._pieces)} announced pieces landed, "
                f"{self._announced_bytes}/{self.expected_bytes} bytes announced, "
                f"fence {'received' if self._fence else 'not received'}")

    # ---- header checks (each raises a HandoffError naming what is wrong) ----------------
    def accept_begin(self, session_id: int, body: dict[str, Any]) -> None:
        if self.state is not InboundState.RESERVED:
            raise HandoffProtocolError(f"transfer {self.transfer_id} already began or ended")
        if body["instance"] != self.instance:
            raise HandoffProtocolError("ticket names another receiver instance (stale ticket)")
        if body["request_id"] != self.request_id:
            raise HandoffProtocolError(
                f"ticket is for request {self.request_id!r}, sender says {body['request_id']!r}")
        heads = body["heads"]
        if heads != list(self.kv.heads):
            raise HandoffLayoutError(
                f"refused transfer {self.transfer_id}: the sender sends KV heads {heads!r}, "
                f"{list(self.kv.heads)} were reserved")
        try:
            self.kv.layout.check_pairs_with(KVLayout.from_dict(body["layout"]), self.kv.heads)
        except LayoutMismatchError as exc:
            raise HandoffLayoutError(f"refused transfer {self.transfer_id}: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise HandoffLayoutError(
                f"refused transfer {self.transfer_id}: bad layout: {exc}") from exc
        if body["digest"] != self.digest_kind:
            raise HandoffLayoutError(
                f"sender digests pieces with {body['digest']!r}, this receiver with "
                f"{self.digest_kind!r}: prefill and decode KV must live on the same device type")
        if body["num_blocks"] != self.num_blocks:
            raise HandoffProtocolError(
                f"sender has {body['num_blocks']} blocks, {self.num_blocks} were reserved")
        self.session_id = session_id
        self.state = InboundState.RECEIVING

    def accept_piece(self, session_id: int, body: dict[str, Any]) -> PieceSpec:
        """Validate a PIECE header against the reservation; nothing is allocated before this."""
        self._check_sender(session_id, "PIECE")
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
        layers = self._bounds(body["layers"], self.kv.num_local_layers, "layers")
        kvs = self._bounds(body["kv"], 2, "kv")
        blocks = self._bounds(body["blocks"], self.num_blocks, "blocks")
        spec = PieceSpec(index, *layers, *blocks, *kvs)
        if spec.nbytes(self.kv) != nbytes:
            raise HandoffProtocolError(
                f"piece {index} claims {nbytes} bytes, its bounds hold {spec.nbytes(self.kv)}")
        region = self._coverage[spec.layer_start:spec.layer_end, spec.kv_start:spec.kv_end,
                                spec.block_start:spec.block_end]
        if region.any():
            raise HandoffProtocolError(f"piece {index} overlaps KV already announced")
        region[...] = True
        self._pieces[index] = _Piece(spec, nbytes, body["digest"])
        self._announced_bytes += nbytes
        return spec

    def accept_fence(self, session_id: int, body: dict[str, Any]) -> None:
        self._check_sender(session_id, "FENCE")
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

    def check_landed(self, spec: PieceSpec, actual: int) -> None:
        """A piece landed with bytes hashing to ``actual``: count it, or raise
        `HandoffDigestError` when that is not what its header announced."""
        expected = self._pieces[spec.index].digest
        if actual != expected:
            raise HandoffDigestError(
                f"piece {spec.index} (layers {spec.layer_start}-{spec.layer_end - 1}) of "
                f"{self.request_id!r} hashes to {actual:#x}, its header said {expected:#x}")
        self._pieces[spec.index].landed = True

    def completion(self) -> FenceInfo | None:
        """The fence outcome once the fence verified and every announced piece landed."""
        if self._fence is None or not all(p.landed for p in list(self._pieces.values())):
            return None
        return FenceInfo(self.request_id, self._fence["first_token_id"], self.num_tokens,
                         self._announced_bytes, len(self._pieces))

    def finish(self, error: HandoffError | None, now: float) -> bool:
        """End the transfer: ready (``error`` None, fence verified) or failed. The caller holds
        ``write_lock`` and calls `publish` after releasing it. Returns False when it had
        already ended (the first outcome stands)."""
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

    def publish(self) -> None:
        """Resolve ``result`` with the outcome `finish` recorded."""
        if self.error is None:
            assert self.fence_info is not None
            self.result.set_result(self.fence_info)
        else:
            self.result.set_exception(self.error)

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
