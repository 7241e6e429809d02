"""`pdserve_timings`: each choice's server-side stage timings, in a whole response or in
the last chunk before [DONE], for clients (such as `pdserve bench`) that join them to
their own measurements."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LONG = [{"role": "user", "content": "Describe the harbour at dawn in some detail. " * 6}]


def test_a_whole_response_carries_one_timings_record_per_choice(served_apps: ServedApps) -> None:
    r = httpx.post(f"{served_apps.url('disagg')}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": LONG, "max_tokens": 6, "n": 2, "seed": 1,
        "pdserve_timings": True})
    assert r.status_code == 200, r.text
    timings = r.json()["pdserve_timings"]
    assert [t["request_id"] for t in timings] == [f"{r.json()['id']}-{i}" for i in range(2)]
    first = timings[0]
    assert first["path"] == "disaggregated" and first["status"] == "ok"
    assert first["num_prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert first["num_output_tokens"] == 6
    for stage in ("tokenize_ms", "decode_reserve_ms", "prefill_compute_ms", "handoff_ms",
                  "ttft_ms", "tpot_ms", "e2e_ms"):
        assert first[stage] is not None and first[stage] >= 0, stage
    assert first["handoff_bytes"] > 0
    assert first["ttft_ms"] <= first["e2e_ms"]


def test_a_stream_ends_with_a_timings_chunk_and_plain_clients_still_read_it(
        served_apps: ServedApps) -> None:
    url = served_apps.url("colo")
    body = {"model": "tiny", "messages": LONG, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "pdserve_timings": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage, timings = json.loads(events[-3]), json.loads(events[-2])
    assert usage["usage"]["completion_tokens"] == 5 and usage["choices"] == []
    assert timings["choices"] == [] and len(timings["pdserve_timings"]) == 1
    assert timings["pdserve_timings"][0]["path"] == "colocated"
    assert timings["pdserve_timings"][0]["num_output_tokens"] == 5
    # The openai client takes the extra chunk as one more chunk without choices.
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = list(oai.chat.completions.create(
        model="tiny", messages=LONG, max_tokens=5, stream=True,
        extra_body={"pdserve_timings": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == []


def test_without_the_flag_nothing_changes(served_apps: ServedApps) -> None:
    r = httpx.post(f"{served_apps.url('colo')}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and "pdserve_timings" not in r.json()
