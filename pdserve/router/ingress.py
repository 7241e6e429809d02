"""The OpenAI-compatible ingress: validate, template, tokenize, run the pipeline, format.

A Serve deployment (see `cluster/app.py`); `build_app` gives its FastAPI routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.tokenizer import Tokenizer
from pdserve.log import configure_logging
from pdserve.router.admission import AdmissionGate
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
    SSE_MEDIA_TYPE,
    ChatStreamFormatter,
    CompletionStreamFormatter,
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


@dataclass
class _Outcome:
    text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str = "stop"
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


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
        self.admission.admit()
        outcome = _Outcome()
        deltas = self.pipeline.generate(rid, ids, params, trace)
        try:
            first = await self._next(deltas, trace)  # errors before token 1 keep their status
        except BaseException:
            self._finish(trace, outcome, "error")
            raise
        if req.stream:
            return StreamingResponse(self._sse(req, rid, trace, first, deltas, outcome, chat),
                                     media_type=SSE_MEDIA_TYPE)
        try:
            self._record(outcome, first)
            async for delta in self._timed(deltas, trace):
                self._record(outcome, delta)
        except BaseException:
            self._finish(trace, outcome, "error")
            raise
        self._finish(trace, outcome, "ok")
        usage = Usage.from_counts(len(ids), outcome.num_output_tokens, outcome.num_cached_tokens)
        model, created = self.settings.served_model_name, unix_time()
        logprobs = (LogprobsFormatter(self.tokenizer)
                    if req.requested_logprobs() is not None else None)
        if chat:
            choice = ChatCompletionChoice(
                message=AssistantMessage(content=outcome.text), finish_reason=outcome.finish_reason,
                logprobs=logprobs.chat(outcome.logprobs) if logprobs else None)
            return JSONResponse(ChatCompletionResponse(
                id=rid, created=created, model=model, choices=[choice], usage=usage
            ).model_dump(mode="json"))
        choice_c = CompletionChoice(
            text=outcome.text, finish_reason=outcome.finish_reason,
            logprobs=logprobs.completion(outcome.logprobs) if logprobs else None)
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=model, choices=[choice_c], usage=usage
        ).model_dump(mode="json"))

    async def _sse(self, req: ChatCompletionRequest | CompletionRequest, rid: str,
                   trace: RequestTrace, first: GenerationDelta,
                   deltas: AsyncIterator[GenerationDelta], outcome: _Outcome,
                   chat: bool) -> AsyncIterator[str]:
        model, created = self.settings.served_model_name, unix_time()
        fmt: ChatStreamFormatter | CompletionStreamFormatter
        if chat:
            fmt = ChatStreamFormatter(rid, model, created, req.include_usage)
            yield fmt.first()
        else:
            fmt = CompletionStreamFormatter(rid, model, created, req.include_usage)
        logprobs = (LogprobsFormatter(self.tokenizer)
                    if req.requested_logprobs() is not None else None)
        status = "cancelled"
        try:
            self._record(outcome, first)
            yield _delta_event(fmt, first, logprobs)
            async for delta in self._timed(deltas, trace):
                self._record(outcome, delta)
                yield _delta_event(fmt, delta, logprobs)
            usage = Usage.from_counts(trace.timings.num_prompt_tokens, outcome.num_output_tokens,
                                      outcome.num_cached_tokens)
            status = "ok"
            yield fmt.finish(outcome.finish_reason, usage)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            status = "error"
            logger.warning("request %s failed mid-stream: %s", rid, exc)
            yield error_event(exc) + DONE_EVENT
        finally:
            await deltas.aclose()
            self._finish(trace, outcome, status)

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

    @staticmethod
    def _record(outcome: _Outcome, delta: GenerationDelta) -> None:
        now = time.monotonic()
        if delta.token_ids:
            if outcome.num_output_tokens == 0:
                outcome.first_token_at = now
            outcome.last_token_at = now
        outcome.text += delta.text
        outcome.logprobs += delta.logprobs
        outcome.num_output_tokens += len(delta.token_ids)
        outcome.num_cached_tokens = max(outcome.num_cached_tokens, delta.num_cached_tokens)
        if delta.finished and delta.finish_reason:
            outcome.finish_reason = delta.finish_reason

    def _finish(self, trace: RequestTrace, outcome: _Outcome, status: str) -> None:
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


def _delta_event(fmt: ChatStreamFormatter | CompletionStreamFormatter, delta: GenerationDelta,
                 logprobs: LogprobsFormatter | None) -> str:
    """The chunk for one delta: its text, and its tokens' logprobs when asked for (a chunk of
    no text still carries those: the detokenizer may hold a partial character back)."""
    if logprobs is not None and delta.logprobs:
        if isinstance(fmt, ChatStreamFormatter):
            return fmt.delta(delta.text, logprobs.chat(delta.logprobs))
        return fmt.delta(delta.text, logprobs.completion(delta.logprobs))
    return fmt.delta(delta.text) if delta.text else ""


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
