"""The ingress's HTTP routes: the OpenAI endpoints, models, health and metrics.

Errors leave as OpenAI error bodies (`http_errors.install_error_handlers`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.admission import AdmissionGate
from pdserve.router.admission_door import AdmissionDoor
from pdserve.router.errors import OverloadedError, ServiceUnavailableError
from pdserve.router.http_errors import error_response, install_error_handlers, unwrap_remote_error
from pdserve.router.http_guard import HttpGuard, HttpGuardSettings
from pdserve.router.metrics import PdserveMetrics
from pdserve.router.openapi import install_openapi
from pdserve.router.protocol import ModelCard, ModelList, unix_time
from pdserve.router.race import Overtaken, unless


class ServedModelSettings(Protocol):
    """The ingress settings the routes read."""

    @property
    def served_model_name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def http(self) -> HttpGuardSettings: ...


class IngressApi(Protocol):
    """What the routes call on the ingress (`ingress.Ingress`): the answers and the gate."""

    @property
    def settings(self) -> ServedModelSettings: ...
    @property
    def admission(self) -> AdmissionGate: ...
    @property
    def metrics(self) -> PdserveMetrics: ...
    async def chat(self, body: bytes) -> Response: ...
    async def completion(self, body: bytes) -> Response: ...
    async def health(self) -> tuple[int, dict[str, Any]]: ...
    async def render_metrics(self) -> bytes: ...


def build_app(ingress: IngressApi) -> FastAPI:
    app = FastAPI(title="pdserve", description="OpenAI-compatible PD-disaggregated serving")
    install_error_handlers(app)
    _count_refusals(app, ingress.metrics)
    # Middleware added last runs first: keys and body size, then admission, then routes.
    app.add_middleware(AdmissionDoor, gate=ingress.admission, metrics=ingress.metrics)
    app.add_middleware(HttpGuard, settings=ingress.settings.http)
    install_openapi(app, ingress.settings.served_model_name, ingress.settings.http)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()  # AdmissionDoor refused a full server's before this
        return await until_disconnected(request, ingress.chat(body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.body()
        return await until_disconnected(request, ingress.completion(body))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=ingress.settings.served_model_name, created=unix_time(),
                         max_model_len=ingress.settings.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json")

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = await ingress.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await ingress.render_metrics(), media_type=ingress.metrics.content_type)

    return app


async def until_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """Await ``answer``, cancelling it when the client disconnects first: nothing else would
    stop a whole (non-streamed) generation nobody will read. A stream's response watches
    for the disconnect itself once it has started."""
    try:
        return await unless(answer, _disconnected(request))
    except Overtaken:
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _count_refusals(app: FastAPI, metrics: PdserveMetrics) -> None:
    """Every 429 and 503 the routes answer is counted by what refused it (these handlers
    take precedence over `install_error_handlers`' for their classes)."""
    ray_kinds = _ray_refusals()

    async def counted(request: Request, exc: Exception) -> Response:
        cause = unwrap_remote_error(exc)
        kind = getattr(cause, "kind", None) or next(
            (k for cls, k in ray_kinds.items() if isinstance(cause, cls)), "unavailable")
        metrics.observe_refusal(kind)
        return error_response(exc, f"{request.method} {request.url.path}")

    for cls in (OverloadedError, ServiceUnavailableError, *ray_kinds):
        app.add_exception_handler(cls, counted)


def _ray_refusals() -> dict[type[Exception], str]:
    """Ray's exceptions that `http_errors` answers 429 or 503, with the refusal reason each
    counts as: a worker's own queue bound, a role Serve cannot reach, a worker that died."""
    try:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    except ImportError:  # pragma: no cover - Ray is a dependency; keep the app importable
        return {}
    return {BackPressureError: "worker_backpressure", DeploymentUnavailableError: "unavailable",
            RayActorError: "worker_died"}
