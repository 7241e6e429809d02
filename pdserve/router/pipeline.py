"""One request's journey through the workers: pick a path, pair the roles, stream tokens.

Serve calls carry the request's lifecycle; its tokens arrive on the token plane. Text out is
exactly what the engines produced; this file adds no tokens, only routing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.decode.api import DecodeCapacityError, DecodeRequest, KVTicket
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill.api import PrefillRequest, PrefillResult
from pdserve.router.decode_call import DecodeCall, HandoffFailedSignal
from pdserve.router.delta import GenerationDelta
from pdserve.router.errors import OverloadedError, ServiceUnavailableError
from pdserve.router.placement import PrefixPlacement
from pdserve.router.prefill_load import LocalPrefillPolicy, PrefillLoad
from pdserve.router.race import Overtaken, unless
from pdserve.router.roles import RoleMonitor, replica_died
from pdserve.router.timings import RequestTrace, reuse_fields
from pdserve.router.token_plane import DecodeGoneError, TokenPlane, retry_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSettings:
    mode: Literal["disaggregated", "colocated"]
    # Prompts shorter than this are prefilled on the decode worker: moving their KV would
    # cost more than recomputing it.
    min_disaggregated_prompt_tokens: int
    # Longer prompts too, while the prefill role is busy (see prefill_load.py).
    local_prefill: LocalPrefillPolicy
    # Whether a role's replicas are ranked by cached prefix (router.*_policy prefix_affinity).
    prefill_ranked: bool = False
    decode_ranked: bool = False
    # Whether prefill workers may pull a cached prefix from each other (engine.peer_kv_pull):
    # the prefill request then names the replicas that hold one.
    peer_pull: bool = False


class GenerationPipeline:
    """Runs a tokenized request on the workers, through whichever path it qualifies for."""

    def __init__(self, decode: Any, prefill: Any | None, settings: PipelineSettings,
                 plane: TokenPlane, roles: RoleMonitor | None = None,
                 placement: PrefixPlacement | None = None) -> None:
        self.decode = decode
        self.prefill = prefill
        self.settings = settings
        self.plane = plane
        self.roles = roles
        self.placement = placement
        self.prefill_load = PrefillLoad(settings.local_prefill)

    def _ranking(self, role: str, prompt_ids: list[int], prefills: bool,
                 trace: RequestTrace | None = None) -> tuple[str, ...]:
        """The role's replicas best first for this prompt (() when the role is not ranked by
        cached prefix); ``prefills``: the replica computes the prompt (its host tier counts)."""
        ranked = self.settings.prefill_ranked if role == "prefill" else self.settings.decode_ranked
        if not ranked or self.placement is None or self.roles is None:
            return ()
        loads = [(load.replica_id, load) for load in self.roles.loads() if load.role == role]
        placement = self.placement.rank(role if not prefills else "prefill", prompt_ids, loads,
                                        feed_role=role)
        if trace is not None and placement.ranking:
            trace.update(routed_cached_tokens=min(
                placement.cached_tokens(placement.ranking[0]), len(prompt_ids)))
        return placement.ranking

    def _peer_prefixes(self, prompt_ids: list[int]) -> tuple[tuple[str, int], ...]:
        if not self.settings.peer_pull or self.placement is None or self.roles is None:
            return ()
        replicas = [load.replica_id for load in self.roles.loads() if load.role == "prefill"]
        return self.placement.peer_prefixes(prompt_ids, replicas)

    def choose_path(self, num_prompt_tokens: int) -> tuple[str, str | None]:
        """The request's path, and why it is not the planned one (None: it is)."""
        missing = self.roles.missing() if self.roles is not None else []
        if "decode" in missing:
            raise ServiceUnavailableError("no decode replica is running; retry shortly",
                                          kind="no_decode_replica")
        if self.settings.mode == "colocated" or self.prefill is None:
            return "colocated", None
        if num_prompt_tokens < self.settings.min_disaggregated_prompt_tokens:
            return "local_prefill", None
        if "prefill" in missing:
            return "local_prefill", "no_prefill_replica"
        if self.roles is not None and self.roles.counts is not None:
            loads = self.roles.loads()
            self.prefill_load.report(sum(load.num_queued_tokens for load in loads
                                         if load.role == "prefill"),
                                     self.roles.counts.get("prefill", 1))
            lender = max((load for load in loads if load.role == "decode"),
                         key=lambda load: load.lend_tokens_per_s, default=None)
            if lender is not None:
                self.prefill_load.report_decode(self.roles.counts.get("decode", 1),
                                                lender.lend_tokens_per_s, lender.prompt_token_us)
        reason = self.prefill_load.prefill_here(num_prompt_tokens)
        if reason is not None:
            return "local_prefill", reason
        return "disaggregated", None

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        trace: RequestTrace, stream: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """The request's deltas; a streamed one as they come, otherwise the first and then
        one with the rest."""
        path, reason = self.choose_path(len(prompt_ids))
        trace.update(path=path, num_prompt_tokens=len(prompt_ids), fallback_reason=reason)
        if path == "disaggregated":
            deltas = self._disaggregated(request_id, prompt_ids, params, trace, stream)
        else:
            deltas = self._on_decode(request_id, prompt_ids, params, (), trace, stream)
        # A long prompt holds its decode replica's turn until its first token.
        lent = reason == "prefill_busy_long"
        if lent:
            self.prefill_load.lend_begin()
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    if lent:
                        lent = False
                        self.prefill_load.lend_end()
                    yield delta
        finally:
            if lent:
                self.prefill_load.lend_end()

    async def _on_decode(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        resume_output_ids: tuple[int, ...], trace: RequestTrace, stream: bool,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Prefill and decode on a decode worker (``resume_output_ids``: tokens the client
        already has, recomputed rather than generated)."""
        request = DecodeRequest(request_id, prompt_ids, params, local_prefill=True,
                                sink=await self.plane.sink(),
                                resume_output_ids=resume_output_ids,
                                replica_ranking=self._ranking("decode", prompt_ids, True, trace))
        async with self._decode_call(request, trace, stream) as call:
            call.follow()
            async for delta in call.deltas():
                yield delta

    async def _disaggregated(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        trace: RequestTrace, stream: bool,
    ) -> AsyncGenerator[GenerationDelta, None]:
        request = DecodeRequest(request_id, prompt_ids, params, local_prefill=False,
                                sink=await self.plane.sink(),
                                replica_ranking=self._ranking("decode", prompt_ids, False))
        fallback: tuple[str, tuple[int, ...]] | None = None
        async with self._decode_call(request, trace, stream) as call:
            try:
                result = await self._prefill_paired(request, call, trace)
            except _Recompute as why:
                fallback = (why.path, ())
            else:
                first_logprobs = [result.first_logprobs] if result.first_logprobs else []
                call.sub.continue_from((result.first_token_id,))
                yield GenerationDelta(result.first_text, [result.first_token_id],
                                      num_cached_tokens=result.num_cached_tokens,
                                      logprobs=first_logprobs)
                call.follow(prefill_done=time.monotonic())
                try:
                    async for delta in call.deltas():
                        yield delta
                except HandoffFailedSignal as failed:
                    trace.update(fallback_reason="handoff_failed", handoff_error=failed.code)
                    fallback = ("recompute_fallback", (result.first_token_id,))
        if fallback is not None:  # the decode call above is over and its stream closed
            trace.update(path=fallback[0])
            async with aclosing(self._on_decode(retry_id(request_id), prompt_ids, params,
                                                fallback[1], trace, stream)) as deltas:
                async for delta in deltas:
                    yield delta

    async def _prefill_paired(self, request: DecodeRequest, call: DecodeCall,
                              trace: RequestTrace) -> PrefillResult:
        """The decode worker's ticket, then the prefill worker's answer; `_Recompute` when
        the prompt must be prefilled on decode instead."""
        reserve_start = time.monotonic()
        try:
            ticket = await call.next_event()
        except DecodeCapacityError as exc:
            raise OverloadedError(1.0, reason=str(exc).splitlines()[-1],
                                  kind="kv_cache_full") from exc
        assert isinstance(ticket, KVTicket), ticket
        trace.update(decode_reserve_ms=(time.monotonic() - reserve_start) * 1000.0)
        prefill_call = self.prefill.prefill.remote(  # type: ignore[union-attr]
            PrefillRequest(request.request_id, request.prompt_token_ids,
                           request.sampling_params, ticket.ticket, ticket.num_cached_tokens,
                           self._ranking("prefill", request.prompt_token_ids, True, trace),
                           self._peer_prefixes(request.prompt_token_ids)))
        queued = len(request.prompt_token_ids) - ticket.num_cached_tokens
        self.prefill_load.begin(queued)
        try:
            result: PrefillResult = await self._prefill_result(prefill_call)
        except _PrefillGone:  # no prefill replica to wait for: prefill on decode now
            trace.update(fallback_reason="no_prefill_replica")
            raise _Recompute("local_prefill") from None
        except Exception as exc:  # noqa: BLE001 - any prefill failure: recompute on decode
            logger.warning("prefill of %s failed, recomputing on decode: %s",
                           request.request_id, exc)
            self._note_failure("prefill", exc)
            trace.update(fallback_reason="prefill_failed")
            raise _Recompute("recompute_fallback") from None
        finally:
            self.prefill_load.end(queued)
            prefill_call.cancel()
        if self.roles is not None:
            self.roles.observe_queue(result.replica_id, result.queue)
        trace.update(prefill_queue_ms=result.queue_s * 1000.0,
                     prefill_compute_ms=result.compute_s * 1000.0,
                     prefix_hit_tokens=result.num_cached_tokens,
                     prefill_tokens_computed=result.num_computed_tokens,
                     **reuse_fields(result.kv_reuse))
        return result

    @asynccontextmanager
    async def _decode_call(self, request: DecodeRequest, trace: RequestTrace,
                           stream: bool) -> AsyncIterator[DecodeCall]:
        call = DecodeCall(self.decode, self.plane, request, trace, stream)
        try:
            yield call
        except Exception as exc:
            self._note_failure("decode", exc)
            raise
        finally:
            await call.close()

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
        died = replica_died(exc) or isinstance(exc, DecodeGoneError)
        if self.roles is not None and died:
            self.roles.report_dead(role)


class _PrefillGone(Exception):
    """The prefill role has no live replica to run this request."""


class _Recompute(Exception):
    """The prompt is prefilled on decode after all (``path`` says how it is counted)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path
