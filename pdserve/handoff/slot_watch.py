"""Receiver side of read slots: a watcher thread per sender session sleeps on the session's
bell (a futex word in the sender's slots region) and hands each record that its transfers'
slots publish, in order and only once its check passed, to the receiver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.handoff.errors import HandoffError, HandoffProtocolError
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.read_slots import (
    NUM_SLOTS,
    SlotBegin,
    SlotRegion,
    claim_mark,
    decode_begin_head,
    decode_begin_ids,
    decode_record,
    num_begin_records,
)
from pdserve.handoff.ucp_memory import PeerMemory

log = logging.getLogger(__name__)
# A record the count says is published but whose check keeps failing this long: the sender
# lies or reused the slot (its transfer is over for it). Retried meanwhile (weak ordering).
BAD_RECORD_S = 1.0
_RETRY_S = 0.001
# With nothing rung, look at the followed transfers this often anyway (ended ones are dropped).
IDLE_WAIT_S = 0.5

RecordHandler = Callable[[InboundTransfer, int, dict[str, Any]], bool]
ErrorHandler = Callable[[InboundTransfer, HandoffError], None]
# (slot, tag, its begin records) -> the transfer to follow in it, or None: not one of ours.
ClaimHandler = Callable[[int, int, SlotBegin], "InboundTransfer | None"]


@dataclass(eq=False)
class _Follow:
    record: InboundTransfer
    slot: int
    tag: int
    consumed: int = 0
    bad_since: float | None = None


class SlotWatcher:
    """Follows the slots of one sender session's read transfers.

    ``on_record(record, kind, body)`` runs on the watcher thread for each valid record and
    returns whether to keep following that transfer; ``on_error`` reports a slot that broke
    the protocol; ``claim`` is offered every slot whose begin records are complete and valid
    but that nobody follows yet (a transfer the sender began after this watcher started: it
    can start before its BEGIN and SOURCE frames arrive). Holds a pin on the slots region
    until the thread exits (after `stop`).
    """

    def __init__(self, name: str, memory: PeerMemory, bell: int, on_record: RecordHandler,
                 on_error: ErrorHandler, claim: ClaimHandler | None = None) -> None:
        if not memory.pin():
            raise HandoffProtocolError("the sender's slots region is already unmapped")
        self.memory, self.bell = memory, bell
        self._region = SlotRegion(memory.array)
        self._on_record, self._on_error, self._claim = on_record, on_error, claim
        self._follows: list[_Follow] = []
        self._offered: set[tuple[int, int]] = set()  # (slot, tag) claimed or refused: done
        self._begins_seen = -1  # the bell's count of opened slots at the last look
        self._recheck_until = 0.0  # some begin records were not all valid yet: look again
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once stopped or dead (a bug logged by the thread): follow nothing more."""
        return not self._stopped and self._thread.is_alive()

    def follow(self, record: InboundTransfer, slot: int, tag: int) -> None:
        """Follow ``record``'s pieces and fence in ``slot`` (after its begin records)."""
        with self._lock:
            self._follows.append(_Follow(record, slot, tag, num_begin_records(record.num_blocks)))
        self._region.ring(self.bell)  # records published before this call were rung unseen

    def stop(self) -> None:
        self._stopped = True
        self._region.ring(self.bell)

    def _run(self) -> None:
        try:
            while not self._stopped:
                seen = self._region.bell(self.bell)
                retry = self._scan()
                if not self._stopped:
                    self._region.wait(self.bell, seen, _RETRY_S if retry else IDLE_WAIT_S)
        except Exception:  # never silently: its transfers end at their deadlines
            log.exception("read slot watcher %s died", self._thread.name)
        finally:
            self.memory.unpin()

    def _scan(self) -> bool:
        """Hand on every new record; True if some transfer waits on a record to turn valid."""
        with self._lock:
            follows = list(self._follows)
        claimed = self._claim_new(follows)
        if claimed:
            with self._lock:
                self._follows.extend(claimed)
            follows += claimed
        ended, retry = [], False
        for follow in follows:
            try:
                keep = not follow.record.terminal and self._advance(follow)
            except Exception as exc:  # a bug: end this transfer loudly, keep serving the rest
                log.exception("read slot %d of %r", follow.slot, follow.record.request_id)
                self._on_error(follow.record, HandoffError(f"reading its slot failed: {exc}"))
                keep = False
            if not keep:
                ended.append(follow)
            retry |= keep and follow.bad_since is not None
        if ended:
            with self._lock:
                self._follows = [f for f in self._follows if f not in ended]
        return retry

    def _claim_new(self, follows: list[_Follow]) -> list[_Follow]:
        """Slots opened since the last look (the bell's count of opened slots moved) that
        nobody follows, each offered to ``claim`` once its begin records are all published
        and valid. Slots whose records are not valid yet are looked at again on every ring
        for up to `BAD_RECORD_S` (weak ordering), then only when the count moves again."""
        begins = self._region.begins(self.bell)
        now = time.monotonic()
        if self._claim is None or (begins == self._begins_seen and now > self._recheck_until):
            return []
        self._begins_seen = begins
        followed = {follow.slot for follow in follows}
        claimed, pending = [], False
        for slot in self._region.announced().tolist():
            tag, _ = self._region.header(slot)
            if slot in followed or (slot, tag) in self._offered:
                continue
            begin = self._begin_in(slot, tag)
            if begin is None:
                pending = True
                continue
            if len(self._offered) >= 4 * NUM_SLOTS:  # old leases' entries: forget them all
                self._offered.clear()
            self._offered.add((slot, tag))
            try:
                record = self._claim(slot, tag, begin)
            except Exception:  # a bug: the frames still start this transfer; keep watching
                log.exception("claiming read slot %d failed", slot)
                continue
            if record is not None:
                self._region.claim(slot, claim_mark(tag, begin.instance))  # no frames needed
                claimed.append(_Follow(record, slot, tag, num_begin_records(begin.num_blocks)))
        if not pending:
            self._recheck_until = 0.0
        elif now > self._recheck_until:
            self._recheck_until = now + BAD_RECORD_S
        return claimed

    def _begin_in(self, slot: int, tag: int) -> SlotBegin | None:
        """The slot's begin records, if all are published and pass their checks."""
        head = decode_begin_head(self._region.record(slot, 0), tag)
        if head is None:
            return None
        first = num_begin_records(head.num_blocks)
        if first > self._region.published(slot):
            return None
        return decode_begin_ids(head, self._region.records(slot, 1, first), tag)

    def _advance(self, follow: _Follow) -> bool:
        published = self._region.published(follow.slot)
        while follow.consumed < published:
            decoded = decode_record(self._region.record(follow.slot, follow.consumed), follow.tag)
            if decoded is None:
                now = time.monotonic()
                follow.bad_since = follow.bad_since or now
                if now - follow.bad_since < BAD_RECORD_S:
                    return True
                self._on_error(follow.record, HandoffProtocolError(
                    f"read slot record {follow.consumed} still fails its check after "
                    f"{BAD_RECORD_S}s"))
                return False
            follow.bad_since = None
            follow.consumed += 1
            if not self._on_record(follow.record, *decoded):
                return False
        return True
