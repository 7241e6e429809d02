"""The OpenAI-compatible ingress: validate, template, tokenize, run the pipeline, format.

A Serve deployment (see `cluster/app.py`); `build_app` gives its FastAPI routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

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
from pdserve.router.errors import ModelNotFoundError, RequestTimeoutError
from pdserve.router.http_errors import install_error_handlers
from pdserve.router.logprobs import LogprobsFormatter
from pdserve.router.metrics import PdserveMetrics
from pdserve.router.pipeline import (
    GenerationDelta,
    GenerationPipeline,
    PipelineSettings,
    RequestTrace,
)
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    resolve_max_tokens,
    to_sampling_params,
)
from pdserve.router.protocol_responses import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    new_request_id,
    unix_time,
)
from pdserve.router.sse import (
    DONE_EVENT,
    ChatStreamFormatter,
    CompletionStreamFormatter,
    EventStreamResponse,
    error_event,
)
from pdserve.router.timings import time_per_output_token_ms

logger = logging.getLogger("pdserve.requests")  # one JSON line per request


@dataclass(frozen=True)
class IngressSettings:
    model_path: str
    served_model_name: str
    max_model_len: int
    max_in_flight: int
    request_timeout_s: float
    pipeline: PipelineSettings


class Ingress:
    """One ingress replica: tokenizer, pipeline, admission gate and metrics."""

    def __init__(self, decode: Any, prefill: Any | None, settings: IngressSettings) -> None:
        configure_logging()
        self.settings = settings
        self.tokenizer = Tokenizer.from_checkpoint(settings.model_path)
        self.pipeline = GenerationPipeline(decode, prefill, settings.pipeline)
        self.admission = AdmissionGate(settings.max_in_flight)
        self.metrics = PdserveMetrics()
        self.decode = decode
        self.prefill = prefill

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self)

    # ---- requests ----------------------------------------------------------------------
    async def chat(self, body: bytes) -> Response:
        req = parse_request(ChatCompletionRequest, body)
        rid = new_request_id("chat")
        trace = RequestTrace(rid)
        self._check(req)
        prompt = self.tokenizer.apply_chat_template(req.template_messages())
        return await self._serve(req, rid, trace, self.tokenizer.encode(prompt), chat=True)

    async def completion(self, body: bytes) -> Response:
        req = parse_request(CompletionRequest, body)
        rid = new_request_id("completion")
        trace = RequestTrace(rid)
        self._check(req)
        ids = req.prompt if isinstance(req.prompt, list) else self.tokenizer.encode(req.prompt)
        return await self._serve(req, rid, trace, ids, chat=False)

    def _check(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model != self.settings.served_model_name:
            raise ModelNotFoundError(req.model, [self.settings.served_model_name])

    async def _serve(self, req: ChatCompletionRequest | CompletionRequest, rid: str,
                     trace: RequestTrace, ids: list[int], chat: bool) -> Response:
        trace.update(tokenize_ms=trace.ms_since_start())
        max_tokens = resolve_max_tokens(req, len(ids), self.settings.max_model_len)
        params = to_sampling_params(req, max_tokens)
        self.admission.admit(req.n)
        runs = self._start_choices(trace, ids, params, req.n)
        try:  # errors before every choice's first token keep their HTTP status
            firsts = await self._first_deltas(runs)
        except BaseException:
            await self._end_all(runs, "error")
            raise
        for run, first in zip(runs, firsts, strict=True):
            run.outcome.record(first, time.monotonic())
        if req.stream:
            return EventStreamResponse(self._sse(req, rid, runs, firsts, len(ids), chat),
                                       lambda: self._end_all(runs, "cancelled"))
        try:
            await gather_or_cancel([self._drain(run) for run in runs])
        except BaseException:
            await self._end_all(runs, "error")
            raise
        await self._end_all(runs, "ok")
        return JSONResponse(self._response(req, rid, runs, len(ids), chat))

    def _start_choices(self, trace: RequestTrace, ids: list[int], params: SamplingParams,
                       num_choices: int) -> list[ChoiceRun]:
        """One pipeline run per choice, each traced (and logged) on its own; the first keeps
        the request's trace, all count from the request's arrival."""
        runs, base_id = [], trace.timings.request_id
        for index in range(num_choices):
            request_id = choice_request_id(base_id, index, num_choices)
            choice_trace = trace if index == 0 else RequestTrace(request_id, trace.started)
            choice_trace.update(request_id=request_id, tokenize_ms=trace.timings.tokenize_ms)
            deltas = self.pipeline.generate(request_id, ids, choice_params(params, index),
                                            choice_trace)
            runs.append(ChoiceRun(index, choice_trace, deltas))
        return runs

    async def _first_deltas(self, runs: list[ChoiceRun]) -> list[GenerationDelta]:
        """Every choice's first delta. The first choice runs alone until then: its prompt's
        KV is computed and cached, so the other choices reuse it from the prefix caches
        instead of each computing the whole prompt at the same time."""
        first = await self._next(runs[0].deltas, runs[0].trace)
        rest = await gather_or_cancel([self._next(run.deltas, run.trace) for run in runs[1:]])
        return [first, *rest]

    def _response(self, req: ChatCompletionRequest | CompletionRequest, rid: str,
                  runs: list[ChoiceRun], num_prompt_tokens: int, chat: bool) -> dict[str, Any]:
        usage = _usage(runs, num_prompt_tokens)
        model, created = self.settings.served_model_name, unix_time()
        wants_logprobs = req.requested_logprobs() is not None
        if chat:
            choices = [ChatCompletionChoice(
                index=run.index, message=AssistantMessage(content=run.outcome.text),
                finish_reason=run.outcome.finish_reason,  # type: ignore[arg-type]
                logprobs=(LogprobsFormatter(self.tokenizer).chat(run.outcome.logprobs)
                          if wants_logprobs else None)) for run in runs]
            return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                          usage=usage).model_dump(mode="json")
        texts = [CompletionChoice(
            index=run.index, text=run.outcome.text,
            finish_reason=run.outcome.finish_reason,  # type: ignore[arg-type]
            logprobs=(LogprobsFormatter(self.tokenizer).completion(run.outcome.logprobs)
                      if wants_logprobs else None)) for run in runs]
        return CompletionResponse(id=rid, created=created, model=model, choices=texts,
                                  usage=usage).model_dump(mode="json")

    async def _sse(self, req: ChatCompletionRequest | CompletionRequest, rid: str,
                   runs: list[ChoiceRun], firsts: list[GenerationDelta], num_prompt_tokens: int,
                   chat: bool) -> AsyncIterator[str]:
        model, created = self.settings.served_model_name, unix_time()
        fmt: ChatStreamFormatter | CompletionStreamFormatter = (
            ChatStreamFormatter(rid, model, created, req.include_usage) if chat else
            CompletionStreamFormatter(rid, model, created, req.include_usage))
        # One per choice: the completions' text offsets count on within a choice.
        logprobs = [LogprobsFormatter(self.tokenizer) if req.requested_logprobs() is not None
                    else None for _ in runs]
        status = "cancelled"
        try:
            for run, first in zip(runs, firsts, strict=True):
                if isinstance(fmt, ChatStreamFormatter):
                    yield fmt.first(run.index)
                yield _delta_event(fmt, run.index, first, logprobs[run.index])
            streams = [self._timed(run.deltas, run.trace) for run in runs]
            async with aclosing(merged(streams)) as arrivals:
                async for index, delta in arrivals:
                    run = runs[index]
                    if delta is None:
                        yield fmt.finish(run.outcome.finish_reason, index)  # type: ignore[arg-type]
                        continue
                    run.outcome.record(delta, time.monotonic())
                    yield _delta_event(fmt, index, delta, logprobs[index])
            status = "ok"
            yield fmt.end(_usage(runs, num_prompt_tokens))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            status = "error"
            logger.warning("request %s failed mid-stream: %s", rid, exc)
            yield error_event(exc) + DONE_EVENT
        finally:
            await self._end_all(runs, status)

    async def _drain(self, run: ChoiceRun) -> None:
        async for delta in self._timed(run.deltas, run.trace):
            run.outcome.record(delta, time.monotonic())

    async def _end_all(self, runs: list[ChoiceRun], status: str) -> None:
        """End every choice not ended yet: close its stream (the workers stop), log it."""
        for run in runs:
            if run.status is None:
                run.status = status
                await run.deltas.aclose()
                self._finish(run.trace, run.outcome, status)

    async def _next(self, deltas: AsyncIterator[GenerationDelta],
                    trace: RequestTrace) -> GenerationDelta:
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                first = await deltas.__anext__()
        except TimeoutError as exc:
            await deltas.aclose()
            raise RequestTimeoutError(self.settings.request_timeout_s, "first token") from exc
        trace.update(ttft_ms=trace.ms_since_start())
        return first

    async def _timed(self, deltas: AsyncIterator[GenerationDelta],
                     trace: RequestTrace) -> AsyncIterator[GenerationDelta]:
        remaining = self.settings.request_timeout_s - trace.ms_since_start() / 1000.0
        try:
            async with asyncio.timeout(max(remaining, 0.001)):
                async for delta in deltas:
                    yield delta
        except TimeoutError as exc:
            raise RequestTimeoutError(self.settings.request_timeout_s, "generation") from exc

    def _finish(self, trace: RequestTrace, outcome: ChoiceOutcome, status: str) -> None:
        self.admission.leave()
        trace.update(
            status=status, finish_reason=outcome.finish_reason if status == "ok" else None,
            num_output_tokens=outcome.num_output_tokens, e2e_ms=trace.ms_since_start(),
            prefix_hit_tokens=min(max(trace.timings.prefix_hit_tokens, outcome.num_cached_tokens),
                                  trace.timings.num_prompt_tokens),
            tpot_ms=time_per_output_token_ms(outcome.first_token_at, outcome.last_token_at,
                                             outcome.num_output_tokens),
        )
        self.metrics.observe(trace.timings)
        logger.info("%s", trace.timings.to_log_line())

    async def kv_stats(self) -> dict[str, Any]:
        """Block counts of every role as the ingress sees them (one replica each)."""
        stats = {"decode": await self.decode.kv_stats.remote()}
        if self.prefill is not None:
            stats["prefill"] = await self.prefill.kv_stats.remote()
        return stats


def _delta_event(fmt: ChatStreamFormatter | CompletionStreamFormatter, index: int,
                 delta: GenerationDelta, logprobs: LogprobsFormatter | None) -> str:
    """The chunk for one delta of choice ``index``: its text, and its tokens' logprobs when
    asked for (a chunk of no text still carries those: the detokenizer may hold a partial
    character back)."""
    if logprobs is not None and delta.logprobs:
        if isinstance(fmt, ChatStreamFormatter):
            return fmt.delta(delta.text, logprobs.chat(delta.logprobs), index)
        return fmt.delta(delta.text, logprobs.completion(delta.logprobs), index)
    return fmt.delta(delta.text, index=index) if delta.text else ""


def _usage(runs: list[ChoiceRun], num_prompt_tokens: int) -> Usage:
    """The prompt counts once, whatever ``n``; completion tokens add up over the choices."""
    return Usage.from_counts(num_prompt_tokens, sum(r.outcome.num_output_tokens for r in runs),
                             max(r.outcome.num_cached_tokens for r in runs))


def build_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="pdserve", description="OpenAI-compatible PD-disaggregated serving")
    install_error_handlers(app, extra_exception_classes=_ray_backpressure_classes())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await ingress.chat(await request.body())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await ingress.completion(await request.body())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=ingress.settings.served_model_name, created=unix_time(),
                         max_model_len=ingress.settings.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ingress.metrics.render(), media_type=ingress.metrics.content_type)

    return app


def _ray_backpressure_classes() -> tuple[type[BaseException], ...]:
    try:
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # pragma: no cover - Ray is a dependency; keep the app importable
        return ()
    return (BackPressureError,)
