"""Handoff settings (one frozen record) and the single place that reads them from the environment.

Also the UCX options the transport starts UCX with, and why each is chosen.

UCX settings (what `HandoffConfig.ucx_options` returns) and why:

- ``TLS``: UCX's default set minus CMA (``^cma``) unless ``ucx_tls`` is set. UCX then picks
  the best transport per peer: on one host sysv/posix shared memory, rendezvous included
  ("fragmented copy-in copy-out": the sender copies into shared segments while the receiver
  copies out, ~4.5 GB/s here, as fast as CMA); ``cuda_ipc``/``cuda_copy`` for CUDA memory;
  ``rc``/``dc`` on InfiniBand; TCP otherwise. CMA is left out on purpose: its rendezvous has
  the receiver read the sender's memory with ``process_vm_readv``, and when the sender dies
  mid-read on an endpoint without error handling (which same-host endpoints need, below) UCX
  aborts the *receiving* process (measured: SIGABRT of the decode side). Over shared memory the
  same death fails just that receive ("connection reset"). Narrowing ``TLS`` further is a
  deployment choice (``ucx_tls="tcp,self"`` e.g. where shared memory is unavailable).
- ``RNDV_THRESH=8192``: control messages (a few hundred bytes) go eager through shared memory;
  every KV piece (>= 8 KiB) goes rendezvous, i.e. zero-copy and paced by the receiver: a piece
  moves only once the receiver posted a buffer for it, which is the flow control we rely on.
- ``MEMTYPE_CACHE=n``: UCX's memory-type cache is unsafe with CUDA allocators that reuse
  addresses (ucxx sets it too; we keep it explicit).
- ``WARN_UNUSED_ENV_VARS=n``: ucxx exports UCX_MEMTYPE_CACHE itself; silences a spurious warning.

Progress mode: ucxx's ``thread`` mode (a C++ thread blocked on the worker's epoll, woken by UCX
events) with Python futures completed by ucxx's notifier thread. It costs nothing when idle.
``polling``/``thread-polling`` each spin a core, which a 2-core machine cannot afford.

Endpoint error handling: OFF towards peers on the same host, ON towards other hosts. With it
on, UCX refuses transports that cannot report a peer failure (shared memory, CMA, cuda_ipc)
and falls back to TCP loopback (measured 0.6-0.8 GB/s vs 5-7 GB/s). With it off UCX never tells
us that a peer died, so liveness is ours: heartbeats, a peer-silence timeout and per-transfer
deadlines (see `heartbeat_interval_s`, `peer_timeout_s`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MIB = 1 << 20
ENV_PREFIX = "PDSERVE_HANDOFF_"


@dataclass(frozen=True)
class HandoffConfig:
    """Knobs of one process's handoff transport (sender and receiver roles alike).

    ``auth_token`` is the cluster's shared secret: peers prove they know it (HMAC challenge,
    never sent in clear) before any transfer is accepted.
    """

    auth_token: str
    default_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    send_grace_s: float = 2.0
    receiver_staging_bytes: int = 512 * MIB
    sender_staging_bytes: int = 512 * MIB
    max_piece_bytes: int = 16 * MIB
    # 8 MiB: per-piece costs (headers, thread hops) outweighed pipelining at 16-64 MiB on 2 cores
    min_piece_bytes: int = 8 * MIB
    # Direct pieces (one layer's K or V, straight between the caches) when both sides' blocks
    # run long enough that pieces average this much. Each piece costs ~0.3-0.5 ms of Python
    # and UCX bookkeeping on 2 busy cores, about what staging 1 MiB (two extra copies) costs:
    # measured equal at 1 MiB rows, direct 1.3-1.5x faster at 4 MiB, slower at 256 KiB.
    direct_min_piece_bytes: int = 1 * MIB
    # Same-host receivers read the KV themselves from a prefill cache that lives in UCX shared
    # memory (`HandoffSender.export_cache`): one copy, no message per piece (docs/handoff.md).
    same_host_reads: bool = True
    # Threads that copy read pieces on the decode side: two keep a 2-core box's memory busy
    # while the prefill side hashes (measured 256 MiB: ~1.5x one thread); more only contend.
    read_threads: int = 2
    finished_ttl_s: float = 60.0
    ucx_tls: str | None = None
    net_devices: str | None = None
    extra_ucx_options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.auth_token:
            raise ValueError("HandoffConfig.auth_token must be a non-empty cluster shared secret")
        for name in ("default_timeout_s", "heartbeat_interval_s", "peer_timeout_s",
                     "handshake_timeout_s", "finished_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"HandoffConfig.{name} must be positive, got {getattr(self, name)}")
        if self.send_grace_s < 0:
            raise ValueError(f"HandoffConfig.send_grace_s must be >= 0, got {self.send_grace_s}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"HandoffConfig.peer_timeout_s ({self.peer_timeout_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        # min_piece_bytes above max_piece_bytes is fine: pieces never exceed the max (so
        # lowering only the max keeps working); both must be positive.
        if min(self.min_piece_bytes, self.max_piece_bytes, self.direct_min_piece_bytes) <= 0:
            raise ValueError(
                f"need positive min_piece_bytes ({self.min_piece_bytes}), max_piece_bytes "
                f"({self.max_piece_bytes}) and direct_min_piece_bytes "
                f"({self.direct_min_piece_bytes})"
            )
        if not 1 <= self.read_threads <= 64:
            raise ValueError(f"HandoffConfig.read_threads must be 1..64, got {self.read_threads}")
        for name in ("receiver_staging_bytes", "sender_staging_bytes"):
            if getattr(self, name) < self.max_piece_bytes:
                raise ValueError(
                    f"HandoffConfig.{name} ({getattr(self, name)}) must hold at least one piece "
                    f"(max_piece_bytes={self.max_piece_bytes})"
                )

    def ucx_options(self) -> dict[str, str]:
        """Options for ``ucxx.init`` (UCX config names without the ``UCX_`` prefix)."""
        options = {"RNDV_THRESH": "8192", "MEMTYPE_CACHE": "n", "WARN_UNUSED_ENV_VARS": "n",
                   "TLS": self.ucx_tls or "^cma"}
        if self.net_devices:
            options["NET_DEVICES"] = self.net_devices
        options.update(self.extra_ucx_options)
        return options

    def with_overrides(self, **changes: Any) -> HandoffConfig:
        return replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **defaults: Any) -> HandoffConfig:
        """Build from ``PDSERVE_HANDOFF_*`` variables (e.g. ``PDSERVE_HANDOFF_AUTH_TOKEN``).

        Keyword ``defaults`` apply where the environment says nothing; the environment wins.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults)
        for name, kind in _ENV_FIELDS.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _parse(name, kind, raw)
        if "auth_token" not in values:
            raise ValueError(f"set {ENV_PREFIX}AUTH_TOKEN (the cluster's shared handoff secret)")
        return cls(**values)


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_ENV_FIELDS: dict[str, type] = {
    "auth_token": str,
    "default_timeout_s": float,
    "heartbeat_interval_s": float,
    "peer_timeout_s": float,
    "handshake_timeout_s": float,
    "send_grace_s": float,
    "receiver_staging_bytes": int,
    "sender_staging_bytes": int,
    "max_piece_bytes": int,
    "min_piece_bytes": int,
    "direct_min_piece_bytes": int,
    "same_host_reads": bool,
    "read_threads": int,
    "finished_ttl_s": float,
    "ucx_tls": str,
    "net_devices": str,
}


def _parse(name: str, kind: type, raw: str) -> Any:
    if kind is bool:
        if raw.strip().lower() not in _BOOLS:
            raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not one of {sorted(_BOOLS)}")
        return _BOOLS[raw.strip().lower()]
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from exc
