"""Host memory a same-host peer can map through UCX (``ucp_mem_map`` + rkey + ``ucp_rkey_ptr``):
how a decode worker reads a prefill worker's KV blocks itself, one copy, no message per piece.

ucxx's Python API has no RMA calls, so these few UCP functions go through ctypes on the libucp
that ucxx already loaded. Call only after ucxx is initialised (the handoff transport does).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_MEM_MAP_LENGTH, _MEM_MAP_FLAGS = 1 << 1, 1 << 2  # ucp_mem_map_params field mask bits
_MEM_MAP_ALLOCATE = 1 << 1  # UCX allocates; by default from sysv/posix shared memory
_MEM_ATTR_ADDRESS, _MEM_ATTR_LENGTH = 1 << 0, 1 << 1
MAX_RKEY_BYTES = 4096  # a packed rkey is tens of bytes; bound what a peer may hand us


class UcpMemoryError(RuntimeError):
    """A UCP memory call failed, or memory is not shared the way a peer could map it."""


class _MapParams(ctypes.Structure):
    # ucp_mem_map_params_t's leading fields; UCX reads only those named in field_mask, and the
    # zero tail covers fields newer UCX versions append.
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("flags", ctypes.c_uint), ("prot", ctypes.c_uint),
                ("_reserved", ctypes.c_uint64 * 16)]


class _MemAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("mem_type", ctypes.c_int),
                ("_reserved", ctypes.c_uint64 * 8)]


_VOIDP = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ucp_mem_map": (ctypes.c_int, [_VOIDP, _VOIDP, ctypes.POINTER(_VOIDP)]),
    "ucp_mem_query": (ctypes.c_int, [_VOIDP, _VOIDP]),
    "ucp_rkey_pack": (ctypes.c_int, [_VOIDP, _VOIDP, ctypes.POINTER(_VOIDP),
                                     ctypes.POINTER(ctypes.c_size_t)]),
    "ucp_rkey_buffer_release": (None, [_VOIDP]),
    "ucp_ep_rkey_unpack": (ctypes.c_int, [_VOIDP, _VOIDP, ctypes.POINTER(_VOIDP)]),
    "ucp_rkey_ptr": (ctypes.c_int, [_VOIDP, ctypes.c_uint64, ctypes.POINTER(_VOIDP)]),
    "ucp_rkey_destroy": (None, [_VOIDP]),
}
_lib: ctypes.CDLL | None = None


def _libucp() -> ctypes.CDLL:
    """The libucp this process already runs (the one ucxx loaded), with typed functions."""
    global _lib
    if _lib is None:
        path = next((m.path for m in _mappings() if os.path.basename(m.path).startswith(
            "libucp.so")), None)
        if path is None:
            raise UcpMemoryError("libucp is not loaded: start the handoff transport first")
        lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise UcpMemoryError(f"{what} failed with UCX status {status}")


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    shared: bool
    path: str


def _mappings() -> list[_Mapping]:
    """This process's memory mappings (``/proc/self/maps``)."""
    found = []
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            found.append(_Mapping(start, end, parts[1][3] == "s",
                                  parts[5].strip() if len(parts) > 5 else ""))
    return found


def _shared_mapping_covers(address: int, nbytes: int) -> bool:
    """Whether ``[address, address + nbytes)`` lies inside one shared mapping of this process."""
    return any(m.shared and m.start <= address and address + nbytes <= m.end
               for m in _mappings())


@dataclass(eq=False)
class SharedHostMemory:
    """``nbytes`` of host memory allocated by UCX in shared memory, with its packed rkey.

    Stays mapped until the process exits: tensors over it may outlive the transport (the
    engine's KV cache does), and UCX itself is done with it once the rkey went out.
    """

    address: int
    nbytes: int
    rkey: bytes
    tensor: torch.Tensor = field(repr=False)  # uint8, over the whole region

    @classmethod
    def allocate(cls, context_handle: int, nbytes: int) -> SharedHostMemory:
        lib = _libucp()
        params = _MapParams(field_mask=_MEM_MAP_LENGTH | _MEM_MAP_FLAGS, length=nbytes,
                            flags=_MEM_MAP_ALLOCATE)
        memh = _VOIDP()
        _check(lib.ucp_mem_map(context_handle, ctypes.byref(params), ctypes.byref(memh)),
               f"ucp_mem_map of {nbytes} bytes")
        attr = _MemAttr(field_mask=_MEM_ATTR_ADDRESS | _MEM_ATTR_LENGTH)
        _check(lib.ucp_mem_query(memh, ctypes.byref(attr)), "ucp_mem_query")
        address, length = int(attr.address or 0), int(attr.length)
        if length < nbytes or not _shared_mapping_covers(address, nbytes):
            raise UcpMemoryError(
                "UCX allocated private memory (no sysv/posix shared memory available, see "
                "UCX_ALLOC_PRIO): a peer could not map it")
        buffer, size = _VOIDP(), ctypes.c_size_t()
        _check(lib.ucp_rkey_pack(context_handle, memh, ctypes.byref(buffer),
                                 ctypes.byref(size)), "ucp_rkey_pack")
        try:
            rkey = ctypes.string_at(buffer, size.value)
        finally:
            lib.ucp_rkey_buffer_release(buffer)
        array = (ctypes.c_uint8 * nbytes).from_address(address)
        return cls(address, nbytes, rkey, torch.frombuffer(array, dtype=torch.uint8))

    def contains(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        size = tensor.numel() * tensor.element_size()
        return tensor.device.type == "cpu" and self.address <= start and \
            start + size <= self.address + self.nbytes


@dataclass(eq=False)
class PeerMemory:
    """A same-host peer's `SharedHostMemory` (or part of it) mapped into this process.

    ``array`` is a uint8 view of ``nbytes`` at the peer's ``remote_address``. Reads are plain
    loads: if the peer dies, the mapping (and the bytes it last wrote) stays valid until
    `close`, so a reader never faults. Readers on other threads `pin` it around each use;
    `close` unmaps at once if none holds a pin, else when the last one lets go.
    """

    remote_address: int
    nbytes: int
    array: np.ndarray = field(repr=False)
    _rkey: int = field(repr=False, default=0)
    _pins: int = field(repr=False, default=0)
    _closing: bool = field(repr=False, default=False)
    _lock: threading.Lock = field(repr=False, default_factory=threading.Lock)

    @classmethod
    def map(cls, endpoint_handle: int, rkey: bytes, remote_address: int,
            nbytes: int, writable: bool = False) -> PeerMemory:
        """Unpack ``rkey`` on the endpoint to its owner and map ``nbytes`` at its
        ``remote_address``; refuses (UcpMemoryError) anything not inside the one shared
        mapping this unpack attached, so a lying peer cannot make us read outside what it
        shared (not even another peer's region mapped next to it: UCX's address arithmetic
        does not check bounds). Should UCX ever reuse an attachment, any one shared mapping
        of this process must hold the range instead. UCX attaches the segment read-write;
        unless ``writable``, ``array`` refuses writes (one by mistake would corrupt the
        peer's memory, e.g. its KV cache)."""
        if not 0 < len(rkey) <= MAX_RKEY_BYTES or nbytes <= 0 or remote_address <= 0:
            raise UcpMemoryError("malformed shared-memory description")
        lib = _libucp()
        handle = _VOIDP()
        before = {(m.start, m.end) for m in _mappings() if m.shared}
        _check(lib.ucp_ep_rkey_unpack(endpoint_handle, rkey, ctypes.byref(handle)),
               "ucp_ep_rkey_unpack")
        try:
            local = _VOIDP()
            _check(lib.ucp_rkey_ptr(handle, remote_address, ctypes.byref(local)),
                   "ucp_rkey_ptr (is the peer on another host?)")
            address = int(local.value or 0)
            shared = [m for m in _mappings() if m.shared]
            attached = [m for m in shared if (m.start, m.end) not in before] or shared
            if not any(m.start <= address and address + nbytes <= m.end for m in attached):
                raise UcpMemoryError(
                    f"peer memory [{remote_address:#x}, +{nbytes}) is not inside what it shared")
        except BaseException:
            lib.ucp_rkey_destroy(handle)
            raise
        array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=np.uint8)
        array.flags.writeable = writable
        return cls(remote_address, nbytes, array, int(handle.value or 0))

    def pin(self) -> bool:
        """Keep the mapping until `unpin`; False once it is closing (do not read then)."""
        with self._lock:
            if self._closing:
                return False
            self._pins += 1
            return True

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            last = self._closing and self._pins == 0
        if last:
            self._destroy()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            idle = self._pins == 0
        if idle:
            self._destroy()

    def _destroy(self) -> None:
        with self._lock:
            rkey, self._rkey = self._rkey, 0
        if rkey:
            _libucp().ucp_rkey_destroy(rkey)
