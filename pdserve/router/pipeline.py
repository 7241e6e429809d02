"""One request's journey through the workers: pick a path, pair the roles, stream tokens.

Text out is exactly what the engines produced; this file adds no tokens, only routing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.decode.api import DecodeCapacityError, DecodeEvent, DecodeRequest
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill.api import PrefillRequest, PrefillResult
from pdserve.router.errors import OverloadedError, ServiceUnavailableError
from pdserve.router.prefill_load import LocalPrefillPolicy, PrefillLoad
from pdserve.router.race import Overtaken, unless
from pdserve.router.roles import RoleMonitor, replica_died
from pdserve.router.timings import RequestTimings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSettings:
    mode: Literal["disaggregated", "colocated"]
    # Prompts shorter than this are prefilled on the decode worker: moving their KV would
    # cost more than recomputing it.
    min_disaggregated_prompt_tokens: int
    # Longer prompts too, while the prefill role is busy (see prefill_load.py).
    local_prefill: LocalPrefillPolicy
    # A stream's tokens cross from decode at most once per interval (the first at once).
    stream_interval_s: float


@dataclass(frozen=True)
class GenerationDelta:
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if asked


class RequestTrace:
    """The request's timings as they fill in; frozen `RequestTimings` underneath."""

    def __init__(self, request_id: str, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        self.timings = RequestTimings(request_id=request_id)

    def update(self, **changes: Any) -> None:
        self.timings = self.timings.with_(**changes)

    def ms_since_start(self) -> float:
        return (time.monotonic() - self.started) * 1000.0


class GenerationPipeline:
    """Runs a tokenized request on the workers, through whichever path it qualifies for."""

    def __init__(self, decode: Any, prefill: Any | None, settings: PipelineSettings,
                 roles: RoleMonitor | None = None) -> None:
        self.decode = decode
        self.prefill = prefill
        self.settings = settings
        self.roles = roles
        self.prefill_load = PrefillLoad(settings.local_prefill)

    def choose_path(self, num_prompt_tokens: int) -> tuple[str, str | None]:
        """The request's path, and why it is not the planned one (None: it is)."""
        missing = self.roles.missing() if self.roles is not None else []
        if "decode" in missing:
            raise ServiceUnavailableError("no decode replica is running; retry shortly")
        if self.settings.mode == "colocated" or self.prefill is None:
            return "colocated", None
        if num_prompt_tokens < self.settings.min_disaggregated_prompt_tokens:
            return "local_prefill", None
        if "prefill" in missing:
            return "local_prefill", "no_prefill_replica"
        if self.roles is not None and self.roles.counts is not None:
            reported = [load for load in self.roles.loads() if load.role == "prefill"]
            self.prefill_load.report(sum(load.num_queued_tokens for load in reported),
                                     self.roles.counts.get("prefill", 1))
        if self.prefill_load.prefill_here(num_prompt_tokens):
            return "local_prefill", "prefill_busy"
        return "disaggregated", None

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        trace: RequestTrace, stream: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """The request's deltas; a streamed one as they come (at most one per stream
        interval), otherwise the first and then one with the rest."""
        path, reason = self.choose_path(len(prompt_ids))
        trace.update(path=path, num_prompt_tokens=len(prompt_ids), fallback_reason=reason)
        interval = self.settings.stream_interval_s if stream else None
        if path == "disaggregated":
            deltas = self._disaggregated(request_id, prompt_ids, params, trace, interval)
        else:
            deltas = self._on_decode(request_id, prompt_ids, params, (), interval)
        async for delta in deltas:
            yield delta

    async def _on_decode(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        resume_output_ids: tuple[int, ...], interval: float | None,
    ) -> AsyncIterator[GenerationDelta]:
        request = DecodeRequest(request_id, prompt_ids, params, local_prefill=True,
                                resume_output_ids=resume_output_ids, stream_interval_s=interval)
        events = self.decode.options(stream=True).generate.remote(request)
        try:
            async for event in events:
                yield _delta(event)
        except Exception as exc:
            self._note_failure("decode", exc)
            raise
        finally:
            events.cancel()

    async def _disaggregated(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        trace: RequestTrace, interval: float | None,
    ) -> AsyncIterator[GenerationDelta]:
        request = DecodeRequest(request_id, prompt_ids, params, local_prefill=False,
                                stream_interval_s=interval)
        events = self.decode.options(stream=True).generate.remote(request)
        prefill_call = None
        try:
            reserve_start = time.monotonic()
            try:
                ticket_event: DecodeEvent = await events.__anext__()
            except DecodeCapacityError as exc:
                raise OverloadedError(1.0, reason=str(exc).splitlines()[-1]) from exc
            trace.update(decode_reserve_ms=(time.monotonic() - reserve_start) * 1000.0)
            prefill_call = self.prefill.prefill.remote(  # type: ignore[union-attr]
                PrefillRequest(request_id, prompt_ids, params, ticket_event.ticket or {},
                               ticket_event.num_cached_tokens))
            queued = len(prompt_ids) - ticket_event.num_cached_tokens
            self.prefill_load.begin(queued)
            try:
                result: PrefillResult = await self._prefill_result(prefill_call)
            except _PrefillGone:  # no prefill replica to wait for: prefill on decode now
                events.cancel()
                trace.update(path="local_prefill", fallback_reason="no_prefill_replica")
                async for delta in self._on_decode(request_id, prompt_ids, params, (), interval):
                    yield delta
                return
            except Exception as exc:  # noqa: BLE001 - any prefill failure: recompute on decode
                logger.warning("prefill of %s failed, recomputing on decode: %s", request_id, exc)
                self._note_failure("prefill", exc)
                events.cancel()
                trace.update(path="recompute_fallback", fallback_reason="prefill_failed")
                async for delta in self._on_decode(request_id, prompt_ids, params, (), interval):
                    yield delta
                return
            finally:
                self.prefill_load.end(queued)
            trace.update(prefill_queue_ms=result.queue_s * 1000.0,
                         prefill_compute_ms=result.compute_s * 1000.0,
                         prefix_hit_tokens=result.num_cached_tokens,
                         prefill_tokens_computed=result.num_computed_tokens)
            prefill_done = time.monotonic()
            first_logprobs = [result.first_logprobs] if result.first_logprobs else []
            yield GenerationDelta(result.first_text, [result.first_token_id],
                                  num_cached_tokens=result.num_cached_tokens,
                                  logprobs=first_logprobs)
            async for event in events:
                if event.kind == "handoff_failed":
                    trace.update(path="recompute_fallback", fallback_reason="handoff_failed",
                                 handoff_error=event.error_kind or "other")
                    async for delta in self._on_decode(
                        request_id, prompt_ids, params, (result.first_token_id,), interval
                    ):
                        yield delta
                    return
                if event.handoff_wait_s:
                    trace.update(handoff_ms=event.handoff_wait_s * 1000.0,
                                 handoff_bytes=event.handoff_bytes,
                                 handoff_exposed_ms=(time.monotonic() - prefill_done) * 1000.0)
                yield _delta(event)
        except Exception as exc:
            self._note_failure("decode", exc)
            raise
        finally:
            events.cancel()
            if prefill_call is not None:
                prefill_call.cancel()

    async def _prefill_result(self, call: Any) -> PrefillResult:
        """The prefill call's answer, unless the prefill role is (or becomes) known to have
        no live replica first: Serve would hold the call until a replacement starts."""
        if self.roles is None:
            return await call  # type: ignore[no-any-return]
        gone = self.roles.gone("prefill")
        if gone.is_set():
            raise _PrefillGone
        try:
            return await unless(call, gone.wait())  # type: ignore[no-any-return]
        except Overtaken:
            raise _PrefillGone from None

    def _note_failure(self, role: str, exc: BaseException) -> None:
        if self.roles is not None and replica_died(exc):
            self.roles.report_dead(role)


class _PrefillGone(Exception):
    """The prefill role has no live replica to run this request."""


def _delta(event: DecodeEvent) -> GenerationDelta:
    if event.kind != "tokens":
        raise RuntimeError(f"decode worker sent an unexpected {event.kind!r} event")
    return GenerationDelta(event.text, event.token_ids, event.finished, event.finish_reason,
                           event.num_cached_tokens, event.logprobs)
