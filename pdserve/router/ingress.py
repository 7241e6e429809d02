"""The OpenAI-compatible ingress: admit, build the prompt, run its choices, answer.

A Serve deployment (see `cluster/app.py`); `http_app.build_app` gives its FastAPI routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdserve.engine.kv.events import Tier
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.log import configure_logging
from pdserve.router.admission import AdmissionGate
from pdserve.router.choices import (
    ChoiceOutcome,
    ChoiceRun,
    choice_params,
    choice_request_id,
    gather_or_cancel,
    merged,
)
from pdserve.router.delta import GenerationDelta
from pdserve.router.errors import OverloadedError, RequestTimeoutError, ServiceUnavailableError
from pdserve.router.http_guard import HttpGuardSettings
from pdserve.router.http_socket import tune_serve_http_socket
from pdserve.router.metrics import PdserveMetrics
from pdserve.router.pipeline import GenerationPipeline, PipelineSettings
from pdserve.router.placement import PrefixPlacement
from pdserve.router.prompts import Prompt, PromptBuilder
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    new_request_id,
    resolve_max_tokens,
    to_sampling_params,
    unix_time,
)
from pdserve.router.responses import ResponseContext, StreamWriter, whole_response
from pdserve.router.roles import ReplicaLoad, RoleMonitor, serve_replica_counts
from pdserve.router.sse import DONE_EVENT, error_event
from pdserve.router.stalls import StallSettings, StallWatch, WatchedEventStream, WatchedStream
from pdserve.router.timings import RequestTrace, reuse_fields, time_per_output_token_ms
from pdserve.router.token_plane import TokenPlane

logger = logging.getLogger("pdserve.requests")  # one JSON line per request

DRAINED_MESSAGE = "the server is shutting down and stopped this generation; retry"
# A scrape waits this long for the roles' first load reports (Serve: ~2 report periods).
FIRST_LOADS_WAIT_S = 3.0


@dataclass(frozen=True)
class IngressSettings:
    model_path: str
    served_model_name: str
    max_model_len: int
    max_in_flight_requests: int
    request_timeout_s: float
    pipeline: PipelineSettings
    plane_token: str  # the cluster's token: decode replicas prove they hold it
    http: HttpGuardSettings
    stalls: StallSettings
    kv_block_size: int  # engine.block_size: the prefix index's blocks until a replica reports


class Ingress:
    """One ingress replica: prompt builder, pipeline, admission gate, role monitor, metrics."""

    def __init__(self, decode: Any, prefill: Any | None, settings: IngressSettings) -> None:
        configure_logging()
        tune_serve_http_socket()  # before Serve binds this replica's HTTP port
        self.settings = settings
        self.tokenizer = Tokenizer.from_checkpoint(settings.model_path)
        self.prompts = PromptBuilder(self.tokenizer, settings.max_model_len,
                                     settings.served_model_name)
        self.roles: RoleMonitor | None = None
        ranked = (settings.pipeline.prefill_ranked or settings.pipeline.decode_ranked
                  or settings.pipeline.peer_pull)
        self.placement = (PrefixPlacement(settings.plane_token, settings.kv_block_size)
                          if ranked else None)
        if decode is not None:
            handles = {"decode": decode} | ({"prefill": prefill} if prefill is not None else {})
            self.roles = RoleMonitor(handles, self._replica_counts, on_loads=self._follow_loads)
        self.metrics = PdserveMetrics()
        self.plane = TokenPlane(settings.plane_token, node_ip(),
                                on_inconsistent=self.metrics.observe_inconsistent_output)
        self.pipeline = GenerationPipeline(decode, prefill, settings.pipeline, self.plane,
                                           self.roles, self.placement)
        self.admission = AdmissionGate(settings.max_in_flight_requests)
        self.stalls = StallWatch(self.plane.subscription, settings.stalls)
        # Deadlines of the generations in flight; a drain pulls them in.
        self._deadlines: set[asyncio.Timeout] = set()
        self._drained = False

    def __serve_build_asgi_app__(self) -> FastAPI:
        from pdserve.router.http_app import build_app

        return build_app(self)

    def _follow_loads(self, loads: list[ReplicaLoad]) -> None:
        """Every poll: the prefix index follows exactly the running replicas' KV events."""
        if self.placement is None:
            return
        for role in self.placement.feeds:
            self.placement.sync(role, [(load.replica_id, load) for load in loads
                                       if load.role == role])

    async def _replica_counts(self) -> dict[str, int]:
        from ray import serve

        assert self.roles is not None
        app = serve.get_replica_context().app_name
        return await serve_replica_counts(app, self.roles.handles)

    # ---- requests ----------------------------------------------------------------------
    async def chat(self, body: bytes) -> Response:
        self._admit_any()
        prompt = await self.prompts.chat(body)
        return await self._serve(prompt, new_request_id("chat"), chat=True)

    async def completion(self, body: bytes) -> Response:
        self._admit_any()
        prompt = await self.prompts.completion(body)
        return await self._serve(prompt, new_request_id("completion"), chat=False)

    def _admit_any(self) -> None:
        """Before any work: refuse while full or draining (the gate may have filled while the
        body was read); start watching the roles."""
        self.admission.check_open()
        if self.roles is not None:
            self.roles.start()

    async def _serve(self, prompt: Prompt[Any], rid: str, chat: bool) -> Response:
        req: ChatCompletionRequest | CompletionRequest = prompt.request
        ids = prompt.token_ids
        trace = RequestTrace(rid, prompt.received_at)
        trace.update(tokenize_ms=prompt.build_ms)
        max_tokens = resolve_max_tokens(req, len(ids), self.settings.max_model_len)
        params = to_sampling_params(req, max_tokens)
        self.admission.admit(req.n)
        runs = self._start_choices(trace, ids, params, req.n, req.stream)
        ctx = ResponseContext(req, rid, self.settings.served_model_name, unix_time(), len(ids),
                              chat)
        try:  # errors before every choice's first token keep their HTTP status
            firsts = await self._first_deltas(runs)
        except asyncio.CancelledError:  # the client left
            await self._end_all(runs, "cancelled")
            raise
        except BaseException as exc:
            await self._end_all(runs, "rejected" if isinstance(exc, OverloadedError) else "error")
            raise
        for run, first in zip(runs, firsts, strict=True):
            run.outcome.record(first, time.monotonic())
        if req.stream:
            writer = StreamWriter(ctx, len(runs), self.tokenizer)
            watched = WatchedStream([run.trace.timings.request_id for run in runs],
                                    lambda: self._stop_as(runs, "stalled"))
            return WatchedEventStream(self._sse(writer, runs, firsts),
                                      lambda: self._end_all(runs, "cancelled"), self.stalls,
                                      watched)
        try:
            await gather_or_cancel([self._drain(run) for run in runs])
        except asyncio.CancelledError:
            await self._end_all(runs, "cancelled")
            raise
        except BaseException:
            await self._end_all(runs, "error")
            raise
        await self._end_all(runs, "ok")
        return JSONResponse(whole_response(ctx, runs, self.tokenizer))

    def _start_choices(self, trace: RequestTrace, ids: list[int], params: SamplingParams,
                       num_choices: int, stream: bool) -> list[ChoiceRun]:
        """One pipeline run per choice, each traced (and logged) on its own; the first keeps
        the request's trace, all count from the request's arrival."""
        runs, base_id = [], trace.timings.request_id
        for index in range(num_choices):
            request_id = choice_request_id(base_id, index, num_choices)
            choice_trace = trace if index == 0 else RequestTrace(request_id, trace.started)
            choice_trace.update(request_id=request_id, tokenize_ms=trace.timings.tokenize_ms)
            deltas = self.pipeline.generate(request_id, ids, choice_params(params, index),
                                            choice_trace, stream=stream)
            runs.append(ChoiceRun(index, choice_trace, deltas))
        return runs

    async def _first_deltas(self, runs: list[ChoiceRun]) -> list[GenerationDelta]:
        """Every choice's first delta. The first choice runs alone until then: its prompt's
        KV is computed and cached, so the other choices reuse it from the prefix caches
        instead of each computing the whole prompt at the same time."""
        first = await self._next(runs[0].deltas, runs[0].trace)
        rest = await gather_or_cancel([self._next(run.deltas, run.trace) for run in runs[1:]])
        return [first, *rest]

    async def _sse(self, writer: StreamWriter, runs: list[ChoiceRun],
                   firsts: list[GenerationDelta]) -> AsyncIterator[str]:
        status = "cancelled"
        try:
            for run, first in zip(runs, firsts, strict=True):
                yield writer.opening(run.index, first)
            streams = [self._timed(run.deltas, run.trace) for run in runs]
            async with aclosing(merged(streams)) as arrivals:
                async for index, delta in arrivals:
                    run = runs[index]
                    if delta is None:
                        yield writer.finish(index, run.outcome.finish_reason)
                        continue
                    run.outcome.record(delta, time.monotonic())
                    yield writer.delta(index, delta)
            status = "ok"
            await self._end_all(runs, status)
            yield writer.end(runs)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            status = "error"
            logger.info("request %s ended mid-stream with an error event",
                        writer.ctx.request_id)
            yield error_event(exc) + DONE_EVENT
        finally:
            await self._end_all(runs, status)

    async def _drain(self, run: ChoiceRun) -> None:
        async for delta in self._timed(run.deltas, run.trace):
            run.outcome.record(delta, time.monotonic())

    @staticmethod
    def _stop_as(runs: list[ChoiceRun], reason: str) -> None:
        """The server is about to end these choices (see `stalls.py`): whatever ends them
        then records ``reason`` as their status."""
        for run in runs:
            run.stop_reason = run.stop_reason or reason

    async def _end_all(self, runs: list[ChoiceRun], status: str) -> None:
        """End every choice not ended yet: close its stream (the workers stop), log it."""
        for run in runs:
            if run.status is None:
                run.status = run.stop_reason or status
                await run.deltas.aclose()
                self._finish(run.trace, run.outcome, run.status)

    async def _next(self, deltas: AsyncIterator[GenerationDelta],
                    trace: RequestTrace) -> GenerationDelta:
        try:
            async with self._deadline(trace) as deadline:
                first = await deltas.__anext__()
        except TimeoutError as exc:
            await deltas.aclose()
            raise self._timeout_error(deadline, "first token") from exc
        trace.update(ttft_ms=trace.ms_since_start())
        return first

    async def _timed(self, deltas: AsyncIterator[GenerationDelta],
                     trace: RequestTrace) -> AsyncIterator[GenerationDelta]:
        try:
            async with self._deadline(trace) as deadline:
                async for delta in deltas:
                    yield delta
        except TimeoutError as exc:
            raise self._timeout_error(deadline, "generation") from exc

    def _deadline(self, trace: RequestTrace) -> _Deadline:
        remaining = self.settings.request_timeout_s - trace.ms_since_start() / 1000.0
        return _Deadline(self, max(remaining, 0.001), trace)

    def _timeout_error(self, deadline: _Deadline,
                       stage: str) -> RequestTimeoutError | ServiceUnavailableError:
        if deadline.drained:
            return ServiceUnavailableError(DRAINED_MESSAGE, kind="draining")
        return RequestTimeoutError(self.settings.request_timeout_s, stage)

    def _finish(self, trace: RequestTrace, outcome: ChoiceOutcome, status: str) -> None:
        self.admission.leave()
        if outcome.kv_reuse is not None:
            trace.update(**reuse_fields(outcome.kv_reuse))
        if trace.deadline_passed and status != "ok":
            status = "timeout"
        trace.update(
            status=status, finish_reason=outcome.finish_reason if status == "ok" else None,
            num_output_tokens=outcome.num_output_tokens, e2e_ms=trace.ms_since_start(),
            prefix_hit_tokens=min(max(trace.timings.prefix_hit_tokens, outcome.num_cached_tokens),
                                  trace.timings.num_prompt_tokens),
            tpot_ms=time_per_output_token_ms(outcome.first_token_at, outcome.last_token_at,
                                             outcome.num_output_tokens),
        )
        self.metrics.observe(trace.timings)
        self.metrics.observe_token_gaps(trace.timings.path, outcome.token_gaps)
        logger.info("%s", trace.timings.to_log_line())

    # ---- operations --------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> dict[str, Any]:
        """Stop admitting (503), let generations in flight finish for up to ``timeout_s``,
        then end the rest (streams get an error event and ``[DONE]``). Returns this
        replica's id and how many generations had to be stopped."""
        from ray import serve

        self.admission.draining = True
        deadline = time.monotonic() + timeout_s
        while self.admission.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stopped = self.admission.num_in_flight
        self._drained = True
        now = asyncio.get_running_loop().time()
        for timeout in list(self._deadlines):
            timeout.reschedule(now)
        while self.admission.num_in_flight and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)
        return {"replica_id": serve.get_replica_context().replica_id.unique_id,
                "num_stopped": stopped}

    async def health(self) -> tuple[int, dict[str, Any]]:
        """200 while every role has a running replica, else 503 naming the missing ones."""
        if self.admission.draining:
            return 503, {"status": "draining"}
        if self.roles is None:
            return 200, {"status": "ok"}
        self.roles.start()
        if self.roles.counts is None:
            await asyncio.wait_for(self.roles.refreshed.wait(), timeout=5.0)
        missing = self.roles.missing()
        if missing:
            return 503, {"status": "unavailable", "missing_roles": missing,
                         "replicas": self.roles.counts}
        return 200, {"status": "ok", "replicas": self.roles.counts}

    async def render_metrics(self) -> bytes:
        """The metrics, with every role's load: a replica that just started (or restarted)
        starts watching the roles at its first scrape and waits briefly for their loads."""
        if self.roles is not None:
            self.roles.start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.roles.loads_known.wait(), FIRST_LOADS_WAIT_S)
        loads = self.roles.loads() if self.roles is not None else []
        return self.metrics.render(loads, self.admission.num_in_flight)

    async def token_plane_stats(self) -> dict[str, Any]:
        """This replica's token plane: where it listens and what it received and refused."""
        sink = await self.plane.sink()
        return asdict(self.plane.stats) | {"host": sink.host, "port": sink.port,
                                           "num_subscriptions": len(self.plane.subscriptions())}

    async def prefix_index_stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """The cluster prefix index as this ingress holds it: per role, per replica it
        follows, the blocks it knows in each tier."""
        if self.placement is None:
            return {}
        if self.roles is not None:
            self.roles.start()  # the index follows what the role monitor polls
        return {role: {rid: {tier.value: feed.index.num_blocks(rid, tier)
                             for tier in (Tier.DEVICE, Tier.HOST)}
                       for rid in feed.index.replica_ids}
                for role, feed in self.placement.feeds.items()}

    async def kv_stats(self) -> dict[str, Any]:
        """Block counts of every role as the ingress sees them (one replica each)."""
        stats = {"decode": await self.pipeline.decode.kv_stats.remote()}
        if self.pipeline.prefill is not None:
            stats["prefill"] = await self.pipeline.prefill.kv_stats.remote()
        return stats


def node_ip() -> str:
    """The address other Ray nodes reach this process on (loopback for a local Ray, which
    `pdserve serve` starts on 127.0.0.1); loopback outside Ray."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class _Deadline:
    """A generation's deadline (`asyncio.timeout`), registered with the ingress so that a
    drain can bring it forward; ``drained`` tells the two endings apart."""

    def __init__(self, ingress: Ingress, delay_s: float, trace: RequestTrace) -> None:
        self._ingress = ingress
        self._timeout = asyncio.timeout(delay_s)
        self._trace = trace
        self.drained = False

    async def __aenter__(self) -> _Deadline:
        await self._timeout.__aenter__()
        if self._ingress._drained:
            self._timeout.reschedule(asyncio.get_running_loop().time())
        self._ingress._deadlines.add(self._timeout)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self._ingress._deadlines.discard(self._timeout)
        self.drained = self._ingress._drained
        if self._timeout.expired() and not self.drained:
            self._trace.deadline_passed = True
        return await self._timeout.__aexit__(*exc)
