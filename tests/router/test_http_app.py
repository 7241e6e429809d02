"""The ingress's routes on a stand-in ingress: refusals are OpenAI errors counted by reason,
and /health and /metrics answer whatever admission says.

Requests go through Starlette's TestClient (httpx); no Ray.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient

from pdserve.router.admission import AdmissionGate
from pdserve.router.errors import OverloadedError, ServiceUnavailableError
from pdserve.router.http_app import build_app
from pdserve.router.http_guard import HttpGuardSettings
from pdserve.router.metrics import PdserveMetrics

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@dataclass(frozen=True)
class Settings:
    served_model_name: str = "m"
    max_model_len: int = 128
    http: HttpGuardSettings = HttpGuardSettings(max_body_bytes=1 << 20, api_keys=(),
                                                metrics_require_api_key=True)


@dataclass
class StandInIngress:
    """Answers chat with 200, or raises what `fail_with` holds after admission."""

    settings: Settings = field(default_factory=Settings)
    admission: AdmissionGate = field(default_factory=lambda: AdmissionGate(1))
    metrics: PdserveMetrics = field(default_factory=PdserveMetrics)
    fail_with: Exception | None = None

    async def chat(self, body: bytes) -> Response:
        if self.fail_with is not None:
            raise self.fail_with
        return JSONResponse({"ok": True})

    async def completion(self, body: bytes) -> Response:
        return await self.chat(body)

    async def health(self) -> tuple[int, dict[str, Any]]:
        return (503, {"status": "draining"}) if self.admission.draining else (200, {})

    async def render_metrics(self) -> bytes:
        return self.metrics.render()


@pytest.fixture
def ingress() -> StandInIngress:
    return StandInIngress()


@pytest.fixture
def client(ingress: StandInIngress) -> Iterator[TestClient]:
    with TestClient(build_app(ingress), raise_server_exceptions=False) as test_client:
        yield test_client


def refused(client: TestClient) -> dict[str, float]:
    prefix = "pdserve:requests_refused_total{reason="
    return {line[len(prefix) + 1:].split('"')[0]: float(line.split()[-1])
            for line in client.get("/metrics").text.splitlines() if line.startswith(prefix)}


def test_every_refusal_is_an_openai_error_counted_by_reason(
        client: TestClient, ingress: StandInIngress) -> None:
    assert set(refused(client).values()) == {0.0}  # every reason shows from the first scrape
    ingress.admission.admit(1)  # the server is full
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    ingress.admission.leave()
    ingress.fail_with = OverloadedError(2.0, "no KV room", kind="kv_cache_full")
    assert client.post("/v1/completions", json=CHAT).status_code == 429
    ingress.fail_with = ServiceUnavailableError("no decode", kind="no_decode_replica")
    assert client.post("/v1/chat/completions", json=CHAT).json()["error"]["code"] == (
        "service_unavailable")
    ingress.admission.draining = True
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
    counts = refused(client)
    assert {k: v for k, v in counts.items() if v} == {
        "in_flight_limit": 1, "kv_cache_full": 1, "no_decode_replica": 1, "draining": 1}


def test_health_and_metrics_answer_while_admission_is_full(
        client: TestClient, ingress: StandInIngress) -> None:
    ingress.admission.admit(1)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 429
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
