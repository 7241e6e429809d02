"""One load against one server: requests sent at their arrival times (open loop), capped at
``max_concurrency`` in flight (closed loop when the rate is infinite), with a progress bar.

Every request ends as a record, failures included: none is dropped from the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import Endpoint, send_request
from pdserve.bench.records import RequestRecord
from pdserve.bench.workloads import PromptSpec


@dataclass(frozen=True)
class LoadSpec:
    """How requests arrive: rate (inf: all at once), gamma burstiness, in-flight cap."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError("--request-timeout-s must be > 0")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else \
            f"{self.request_rate:g} req/s ({'Poisson' if self.burstiness == 1 else 'gamma'}, " \
            f"burstiness {self.burstiness:g})"
        cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
        return rate + cap


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to send: its body and the prompt length it was built with."""

    body: dict[str, Any]
    prompt_tokens: int


def prepare(endpoint: Endpoint, prompts: Sequence[PromptSpec],
            texts: Sequence[str] | None = None) -> list[PreparedRequest]:
    return [PreparedRequest(endpoint.body(p, texts[i] if texts is not None else None),
                            len(p.prompt_ids)) for i, p in enumerate(prompts)]


async def _run(endpoint: Endpoint, requests: Sequence[PreparedRequest], load: LoadSpec,
               label: str, times: Sequence[float] | None) -> tuple[list[RequestRecord], float]:
    if times is None:
        times = arrival_times(len(requests), load.request_rate, load.burstiness, load.seed)
    elif len(times) != len(requests):
        raise ValueError(f"{len(times)} arrival times for {len(requests)} requests")
    cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    limits = httpx.Limits(max_connections=load.max_concurrency or len(requests) or 1,
                          max_keepalive_connections=load.max_concurrency or 64)
    timeout = httpx.Timeout(load.request_timeout_s, connect=30.0)
    bar = tqdm(total=len(requests), desc=label, unit="req", leave=True, dynamic_ncols=True)
    failed = 0

    async def one(i: int, client: httpx.AsyncClient, started: float) -> RequestRecord:
        nonlocal failed
        await asyncio.sleep(max(0.0, started + times[i] - time.perf_counter()))
        if cap is None:
            record = await send_request(client, endpoint, requests[i].body, i,
                                        requests[i].prompt_tokens, times[i], started)
        else:
            async with cap:
                record = await send_request(client, endpoint, requests[i].body, i,
                                            requests[i].prompt_tokens, times[i], started)
        failed += not record.ok
        bar.set_postfix(failed=failed, refresh=False)
        bar.update(1)
        return record

    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            started = time.perf_counter()
            records = await asyncio.gather(*(one(i, client, started)
                                             for i in range(len(requests))))
            duration = time.perf_counter() - started
    finally:
        bar.close()
    return list(records), duration


def run_load(endpoint: Endpoint, requests: Sequence[PreparedRequest], load: LoadSpec,
             label: str = "bench", times: Sequence[float] | None = None
             ) -> tuple[list[RequestRecord], float]:
    """Send the requests under ``load`` (at ``times``, seconds from the start, when given:
    a mix of arrival processes); returns every record (in order) and the wall time from the
    first send to the last answer."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    return asyncio.run(_run(endpoint, requests, load, label, times))


def warm_up(endpoint: Endpoint, requests: Sequence[PreparedRequest], load: LoadSpec) -> int:
    """Send requests one after another, unmeasured (first-call costs, a warm prefix cache);
    returns how many failed."""
    if not requests:
        return 0
    records, _ = run_load(endpoint, requests, LoadSpec(max_concurrency=1,
                                                       request_timeout_s=load.request_timeout_s),
                          label="warm-up")
    return sum(not r.ok for r in records)
