"""Configs of the pdserve apps the HTTP-edge fault tests deploy, and checks they share.

`conftest.py` deploys the shared ones once per session on the session's Ray (`ray_serve`).
"""

from __future__ import annotations

from typing import Any

from tests.support.ray_serve import app_config

YAML_KEY = "edge-yaml-key-0123456789abcdef"
ENV_KEY = "edge-env-key-fedcba9876543210"
OPEN_BODY_LIMIT = 64 * 1024
# Short: schemathesis asks for as many tokens as the schema allows, and CPU decode is slow.
OPEN_MAX_MODEL_LEN = 128
ERROR_FIELDS = {"message", "type", "param", "code"}


def open_app_config(model_path: str) -> dict[str, Any]:
    """Disaggregated, no API key; a small body limit and model length, so limit tests and
    fuzzing stay quick."""
    config = app_config(model_path, "disaggregated")
    config["model"]["max_model_len"] = OPEN_MAX_MODEL_LEN
    config["http"] = {"max_body_bytes": OPEN_BODY_LIMIT}
    return config


def keyed_app_config(model_path: str) -> dict[str, Any]:
    """Colocated, one key in YAML; the fixture adds ENV_KEY through $PDSERVE_API_KEY."""
    return app_config(model_path, "colocated") | {"http": {"api_keys": [YAML_KEY]}}


def assert_openai_error(body: Any, code: str | None = None) -> dict[str, Any]:
    """``body`` is OpenAI's error shape (and has ``code``, if given); returns its ``error``."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if code is not None:
        assert error["code"] == code, error
    return error
