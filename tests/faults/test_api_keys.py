"""API keys over real HTTP: missing or wrong -> 401 with OpenAI's body, right -> 200 (httpx and
the openai client), /health open; with no key configured nothing asks for one.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.faults.edge_apps import ENV_KEY, YAML_KEY, assert_openai_error

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
GUARDED = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
           ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/openapi.json", None)]
BAD_AUTHORIZATIONS = [
    None,  # no header at all
    f"Bearer {YAML_KEY[:-1]}x",  # one character off
    f"Bearer {YAML_KEY}{YAML_KEY}",  # a key plus more
    YAML_KEY,  # the key without the Bearer scheme
    f"Basic {YAML_KEY}",
    "Bearer",
]


@pytest.fixture(scope="module")
def keyed(keyed_app: str) -> str:
    return keyed_app


def _call(url: str, method: str, path: str, body: dict | None,
          authorization: str | None) -> httpx.Response:
    headers = {} if authorization is None else {"Authorization": authorization}
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_missing_or_wrong_key_is_refused_with_openai_401(keyed: str,
                                                         authorization: str | None) -> None:
    for method, path, body in GUARDED:
        r = _call(keyed, method, path, body, authorization)
        assert r.status_code == 401, (path, r.text)
        error = assert_openai_error(r.json(), code="invalid_api_key")
        assert error["type"] == "invalid_request_error"
        assert YAML_KEY[:12] not in error["message"]  # no key, not even a near one, echoed
        assert r.headers["www-authenticate"] == "Bearer"


def test_right_keys_from_yaml_and_environment_are_served(keyed: str) -> None:
    for key in (YAML_KEY, ENV_KEY):
        for method, path, body in GUARDED:
            r = _call(keyed, method, path, body, f"Bearer {key}")
            assert r.status_code == 200, (path, r.text)
        r = _call(keyed, "POST", "/v1/chat/completions", CHAT, f"bearer {key}")  # any case
        assert r.json()["usage"]["completion_tokens"] == 2


def test_openai_client_with_right_and_wrong_key(keyed: str) -> None:
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=YAML_KEY, max_retries=0)
    reply = client.chat.completions.create(model="tiny", max_tokens=3, messages=CHAT["messages"])
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    streamed = client.completions.create(model="tiny", prompt="hello", max_tokens=3, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    wrong = openai.OpenAI(base_url=f"{keyed}/v1", api_key="not-the-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="tiny", max_tokens=3, messages=CHAT["messages"])
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_health_needs_no_key(keyed: str) -> None:
    assert _call(keyed, "GET", "/health", None, None).status_code == 200
    assert _call(keyed, "GET", "/health", None, "Bearer wrong").status_code == 200


def test_without_configured_keys_nothing_asks_for_one(open_app: str) -> None:
    for authorization in (None, "Bearer anything-at-all", "Basic abc"):
        for method, path, body in [*GUARDED, ("GET", "/health", None)]:
            r = _call(open_app, method, path, body, authorization)
            assert r.status_code == 200, (path, authorization, r.text)
            assert "www-authenticate" not in r.headers
