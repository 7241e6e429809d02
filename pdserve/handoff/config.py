"""Handoff settings (one frozen record) and the single place that reads them from the environment.

Also the UCX options the transport starts UCX with, and why each is chosen.

UCX settings (what `HandoffConfig.ucx_options` returns) and why:

- ``TLS``: left at UCX's default (``all``) unless ``ucx_tls`` is set. UCX then picks the best
  transport per peer: on one host shared memory (sysv/posix) for small messages and CMA
  (``process_vm_readv``, one copy) for rendezvous; ``cuda_ipc``/``cuda_copy`` for CUDA memory;
  ``rc``/``dc`` on InfiniBand; TCP otherwise. Narrowing it is a deployment choice
  (``ucx_tls="tcp,self"`` e.g. on hosts where CMA is forbidden by ptrace policy).
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
        if self.min_piece_bytes <= 0 or self.max_piece_bytes <= 0:
            raise ValueError(
                f"need positive min_piece_bytes ({self.min_piece_bytes}) and max_piece_bytes "
                f"({self.max_piece_bytes})"
            )
        for name in ("receiver_staging_bytes", "sender_staging_bytes"):
            if getattr(self, name) < self.max_piece_bytes:
                raise ValueError(
                    f"HandoffConfig.{name} ({getattr(self, name)}) must hold at least one piece "
                    f"(max_piece_bytes={self.max_piece_bytes})"
                )

    def ucx_options(self) -> dict[str, str]:
        """Options for ``ucxx.init`` (UCX config names without the ``UCX_`` prefix)."""
        options = {"RNDV_THRESH": "8192", "MEMTYPE_CACHE": "n", "WARN_UNUSED_ENV_VARS": "n"}
        if self.ucx_tls:
            options["TLS"] = self.ucx_tls
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
    "finished_ttl_s": float,
    "ucx_tls": str,
    "net_devices": str,
}


def _parse(name: str, kind: type, raw: str) -> Any:
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from exc
