"""The ranks of one replica as a communication group: sums across ranks, logits gathered on
rank 0, and the step plan rank 0 broadcasts; one rank alone needs none of it.

Explicit process-group objects (no torch.distributed default group), so one process may hold
several groups (tests run ranks as threads) and nothing global is set.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Ranks other than 0 wait for the next step plan as long as their replica sits idle, so the
# group that carries plans has no practical deadline; a dead rank 0 takes its ranks with it
# (they are its Ray actors, and their connections to it close).
_CONTROL_TIMEOUT = datetime.timedelta(days=7)
_STOP = -1  # a plan length that tells the other ranks to leave their loop
# A plan travels in one broadcast of this many bytes (its length, then its first bytes), and
# only what does not fit in a second: one gloo round a step, not two, for most steps (two
# ranks in two processes, a 2 KB plan: 0.54x the time of a length then a payload broadcast).
PLAN_FRAME_BYTES = 32 * 1024
_LENGTH_BYTES = 8


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, or one did not answer within the group's timeout.
    The replica cannot go on; its engine stops and Serve replaces it."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a replica's ranks meet: rank 0's store (host, port) and the group's size."""

    host: str
    port: int
    size: int


class TPGroup:
    """One rank alone: every collective is the identity. `CollectiveGroup` is the real one."""

    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``tensor`` (equal shapes) side by side along the last dim;
        other ranks: None."""
        return tensor

    def broadcast_plan(self, payload: bytes | None) -> bytes | None:
        """Rank 0 sends ``payload`` (None: stop), every other rank returns what it sent."""
        return payload

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank learns it)."""
        return value

    def close(self) -> None:
        """Let go of the connections (idempotent)."""


SINGLE_RANK = TPGroup()


class CollectiveGroup(TPGroup):
    """A replica's ranks over torch.distributed: gloo on CPU, NCCL on CUDA for the model's
    tensors, and gloo for the step plans (host bytes) on either."""

    def __init__(self, rank: int, size: int, device: torch.device, compute: dist.ProcessGroup,
                 control: dist.ProcessGroup, store: dist.Store) -> None:
        self.rank, self.size, self.device = rank, size, device
        self._compute, self._control = compute, control
        self._store = store  # rank 0's is the server: it must outlive the group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        _wait(self._compute.allreduce([tensor]), "all-reduce")
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        tensor = tensor.contiguous()
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.is_first else []
        options = dist.GatherOptions()
        options.rootRank = 0
        _wait(self._compute.gather(outputs, [tensor], options), "gather")
        return torch.cat(outputs[0], dim=-1) if self.is_first else None

    def broadcast_plan(self, payload: bytes | None) -> bytes | None:
        room = PLAN_FRAME_BYTES - _LENGTH_BYTES
        frame = bytearray(PLAN_FRAME_BYTES)
        if self.is_first:
            length = _STOP if payload is None else len(payload)
            frame[:_LENGTH_BYTES] = length.to_bytes(_LENGTH_BYTES, "little", signed=True)
            if payload is not None:
                frame[_LENGTH_BYTES:_LENGTH_BYTES + min(length, room)] = payload[:room]
        head = torch.frombuffer(frame, dtype=torch.uint8)
        _wait(self._control.broadcast([head], _root()), "plan broadcast")
        length = int.from_bytes(frame[:_LENGTH_BYTES], "little", signed=True)
        if length == _STOP:
            return None
        if length > room:  # the rest, in a second broadcast
            rest = (torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
                    if self.is_first and payload is not None
                    else torch.empty(length - room, dtype=torch.uint8))
            _wait(self._control.broadcast([rest], _root()), "plan broadcast")
            if not self.is_first:
                return bytes(frame[_LENGTH_BYTES:]) + rest.numpy().tobytes()
        return payload if self.is_first else bytes(frame[_LENGTH_BYTES:_LENGTH_BYTES + length])

    def min_int(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        _wait(self._control.allreduce([tensor], options), "all-reduce (min)")
        return int(tensor.item())

    def close(self) -> None:
        for group in (self._compute, self._control):
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                with contextlib.suppress(RuntimeError):  # already broken: a peer died
                    shutdown()


def host_store(host: str, size: int, timeout_s: float) -> tuple[Rendezvous, dist.TCPStore]:
    """Rank 0: a store on an OS-chosen port of ``host`` for the group to meet at."""
    store = dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return Rendezvous(host, store.port, size), store


def connect_group(rendezvous: Rendezvous, rank: int, device: torch.device, timeout_s: float,
                  store: dist.Store | None = None) -> CollectiveGroup:
    """Join the group (every rank calls this; it returns once all did). ``timeout_s`` bounds
    each collective of the model (a dead rank fails the others within it); ``store``: rank
    0's from `host_store`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.size, False,
                              timeout=timeout)
    size = rendezvous.size
    control = _gloo(dist.PrefixStore("control", store), rank, size, rendezvous.host,
                    _CONTROL_TIMEOUT)
    if device.type == "cuda":
        compute = _nccl(dist.PrefixStore("compute", store), rank, size, timeout, device)
    else:
        compute = _gloo(dist.PrefixStore("compute", store), rank, size, rendezvous.host, timeout)
    return CollectiveGroup(rank, size, device, compute, control, store)


def _gloo(store: dist.Store, rank: int, size: int, host: str,
          timeout: datetime.timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


# NCCL's collectives run on the device: `_wait` returns before they end, and a collective
# that cannot end (a rank died) is found by NCCL's watchdog thread after the group's timeout.
# TearDown: the watchdog ends this process then, and the replica goes like a killed one (its
# requests end with a clear error; Serve replaces it). The other modes would hang forever (0)
# or abort the collective and let the step go on with a partial sum (2), which could be
# sampled into a wrong answer.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "0"}


def _nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
          device: torch.device) -> dist.ProcessGroup:
    os.environ.update(NCCL_ERROR_HANDLING)  # read when the group is made
    if not dist.is_nccl_available():
        raise CollectiveError("tensor parallelism on CUDA needs torch built with NCCL")
    # NCCL binds its communicator to the current device: make it this rank's before the group.
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, size, options)
    # NCCL makes its communicator at the first collective: make it here, while joining, so the
    # KV sizing's profiled step (and its memory figures) does not pay for it.
    _wait(group.allreduce([torch.zeros(1, device=device)]), "NCCL communicator set-up")
    return group


def _root() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def _wait(work: dist.Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise CollectiveError(f"tensor-parallel {what} failed (a rank died or timed out): "
                              f"{str(exc).splitlines()[0]}") from exc
