"""Why a handoff failed: one exception class per reason, each with a stable wire code.

Both sides raise these; an ABORT message carries the code so the peer raises the same class.
"""

from __future__ import annotations

from pdserve.engine.kv.layout import LayoutMismatchError


class HandoffError(Exception):
    """A KV handoff did not complete. ``code`` names the reason on the wire and in metrics.

    Whenever a receiver-side transfer ends with this error, the receiver has already stopped
    writing into the reserved blocks: the decode worker may free them at once.
    """
    code = "error"


class HandoffTimeoutError(HandoffError):
    """The transfer's deadline passed before its fence verified."""
    code = "timeout"


class HandoffDigestError(HandoffError):
    """A piece's payload does not hash to the digest its header announced."""
    code = "digest"


class HandoffLayoutError(HandoffError, LayoutMismatchError):
    """The sender's KV layout differs from the one reserved; the message names the field."""
    code = "layout"


class HandoffAuthError(HandoffError):
    """The peer did not prove knowledge of the cluster's shared token."""
    code = "auth"


class HandoffPeerGoneError(HandoffError):
    """The peer stopped answering (process died, host unreachable) or its endpoint failed."""
    code = "peer_gone"


class HandoffCancelledError(HandoffError):
    """One side cancelled the transfer (request cancelled, worker shutting down)."""
    code = "cancelled"


class HandoffProtocolError(HandoffError):
    """A message broke the protocol: bad bounds, too many bytes, duplicate piece, bad fence."""
    code = "protocol"


class HandoffCapacityError(HandoffError):
    """A staging buffer bound was hit; the transfer is dropped rather than blocking compute."""
    code = "capacity"


class HandoffUnknownTransferError(HandoffError):
    """The receiver holds no reservation for this transfer (expired, finished or never made)."""
    code = "unknown_transfer"


_BY_CODE: dict[str, type[HandoffError]] = {cls.code: cls for cls in (
    HandoffError, HandoffTimeoutError, HandoffDigestError, HandoffLayoutError, HandoffAuthError,
    HandoffPeerGoneError, HandoffCancelledError, HandoffProtocolError, HandoffCapacityError,
    HandoffUnknownTransferError)}


def error_from_code(code: str, message: str) -> HandoffError:
    """Rebuild the exception a peer reported; unknown codes become a plain `HandoffError`."""
    return _BY_CODE.get(code, HandoffError)(message)
