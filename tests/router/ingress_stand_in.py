"""A real `Ingress` on a stand-in pipeline (no Ray, no workers), for the router tests that
drive its requests and responses directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.delta import GenerationDelta
from pdserve.router.http_guard import HttpGuardSettings
from pdserve.router.ingress import Ingress, IngressSettings
from pdserve.router.pipeline import PipelineSettings
from pdserve.router.prefill_load import LocalPrefillPolicy
from pdserve.router.stalls import StallSettings
from pdserve.router.timings import RequestTrace


class RecordingPipeline:
    """Stands in for the workers: each choice yields one token and finishes, or (``hang``)
    one token and then nothing until closed."""

    def __init__(self, hang: bool = False) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.closed: list[str] = []
        self.hang = hang

    async def generate(self, request_id: str, ids: list[int], params: SamplingParams,
                       trace: RequestTrace, stream: bool = True,
                       ) -> AsyncIterator[GenerationDelta]:
        self.calls.append((request_id, params.seed))
        trace.update(path="colocated", num_prompt_tokens=len(ids))
        try:
            async for delta in self.deltas(request_id):
                yield delta
        finally:
            self.closed.append(request_id)

    async def deltas(self, request_id: str) -> AsyncIterator[GenerationDelta]:
        """One choice's output (what subclasses change)."""
        yield GenerationDelta(f"<{request_id}>", [1], finished=not self.hang,
                              finish_reason=None if self.hang else "length")
        if self.hang:
            await asyncio.Event().wait()


STALLS = StallSettings(5.0, 8 << 20)


def ingress_with(checkpoint: str, pipeline: RecordingPipeline, request_timeout_s: float = 30.0,
                 stalls: StallSettings = STALLS) -> Ingress:
    """An ingress admitting 8 generations at once, its pipeline replaced by ``pipeline``."""
    paths = PipelineSettings("colocated", 16, LocalPrefillPolicy(0, 0))
    http = HttpGuardSettings(max_body_bytes=4 << 20, api_keys=(), metrics_require_api_key=True)
    settings = IngressSettings(checkpoint, "tiny", 256, 8, request_timeout_s, paths,
                               plane_token="a-cluster-token-0123456789", http=http,
                               stalls=stalls, kv_block_size=16)
    ingress = Ingress(decode=None, prefill=None, settings=settings)
    ingress.pipeline = pipeline  # type: ignore[assignment]
    return ingress
