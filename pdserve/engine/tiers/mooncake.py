"""The shared KV tier's client on Mooncake Store: a master holds the metadata, every worker
mounts a segment of its memory into the pool and reads and writes blocks over TCP (RDMA on
GPU clusters) through one registered staging buffer.

Implements the engine's `BlockStore`; imported only when `kv_store.enabled` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.tiers.store import StoreUnavailableError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MooncakeSettings:
    """Where the store is and what this worker gives it (config section ``kv_store``)."""

    master_address: str  # host:port of mooncake_master's RPC
    metadata_server: str  # http://host:port/metadata (the master's own HTTP metadata server)
    local_hostname: str  # this worker's address for the store's transfers
    segment_bytes: int  # memory this worker mounts into the shared pool
    staging_bytes: int  # the registered buffer blocks travel through
    protocol: str  # "tcp" or "rdma"
    device_name: str  # RDMA devices for rdma


class MooncakeBlockStore:
    """One worker's Mooncake Store client (`tiers/store.py` `BlockStore`): calls from one thread."""

    def __init__(self, settings: MooncakeSettings) -> None:
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        rc = self._store.setup(settings.local_hostname, settings.metadata_server,
                               settings.segment_bytes, settings.staging_bytes,
                               settings.protocol, settings.device_name,
                               settings.master_address)
        if rc != 0:
            raise StoreUnavailableError(f"Mooncake Store setup at {settings.master_address} "
                                        f"failed (code {rc})")
        self.staging = torch.zeros(settings.staging_bytes, dtype=torch.uint8)
        self._base = self.staging.data_ptr()
        rc = self._store.register_buffer(self._base, settings.staging_bytes)
        if rc != 0:
            self._store.close()
            raise StoreUnavailableError(f"Mooncake Store refused the staging buffer (code {rc})")

    def _rows(self, count: int, row_bytes: int) -> tuple[list[int], list[int]]:
        return [self._base + i * row_bytes for i in range(count)], [row_bytes] * count

    def put(self, keys: Sequence[str], row_bytes: int) -> list[bool]:
        ptrs, sizes = self._rows(len(keys), row_bytes)
        codes = self._call("batch_put_from", list(keys), ptrs, sizes)
        if codes and all(c < 0 for c in codes) and not _all_exist(codes):
            raise StoreUnavailableError(f"Mooncake Store put failed: codes {sorted(set(codes))}")
        return [c >= 0 or c in _ALREADY_EXISTS for c in codes]

    def get(self, keys: Sequence[str], row_bytes: int) -> list[bool]:
        ptrs, sizes = self._rows(len(keys), row_bytes)
        return [c == row_bytes for c in self._call("batch_get_into", list(keys), ptrs, sizes)]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._call("batch_is_exist", list(keys))
        if codes and all(c < 0 for c in codes):
            raise StoreUnavailableError(f"Mooncake Store lookup failed: codes "
                                        f"{sorted(set(codes))}")
        return [c == 1 for c in codes]

    def close(self) -> None:
        try:
            self._store.unregister_buffer(self._base)
            self._store.close()
        except Exception:  # noqa: BLE001 - a store that is gone has nothing to close
            logger.debug("closing the Mooncake Store client failed", exc_info=True)

    def _call(self, name: str, *args: object) -> list[int]:
        try:
            return [int(c) for c in getattr(self._store, name)(*args)]
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeErrors
            raise StoreUnavailableError(f"Mooncake Store {name} failed: {exc}") from exc


# Mooncake's OBJECT_ALREADY_EXISTS: another worker put the same block first.
_ALREADY_EXISTS = frozenset({-705})


def _all_exist(codes: list[int]) -> bool:
    return all(c in _ALREADY_EXISTS for c in codes)


def connect_store(settings: MooncakeSettings, local_hostname: str) -> MooncakeBlockStore | None:
    """This worker's client, or None (logged) when the store cannot be reached: the worker
    then serves without the shared tier."""
    import dataclasses

    try:
        return MooncakeBlockStore(dataclasses.replace(settings, local_hostname=local_hostname))
    except (StoreUnavailableError, ImportError, RuntimeError) as exc:
        logger.warning("serving without the shared KV store: %s", exc)
        return None
