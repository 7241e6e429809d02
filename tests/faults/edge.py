"""Configs of the pdserve apps the HTTP-edge fault tests deploy, and what those tests share.

Each app is deployed once per package run (see conftest.py) under its name as route prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

YAML_KEY = "edge-yaml-key-0123456789abcdef"
ENV_KEY = "edge-env-key-fedcba9876543210"
HANDOFF_TOKEN = "edge-handoff-token-0123456789"
OPEN_BODY_LIMIT = 64 * 1024
# Short: schemathesis asks for as many tokens as the schema allows, and CPU decode is slow.
OPEN_MAX_MODEL_LEN = 128
ERROR_FIELDS = {"message", "type", "param", "code"}


def edge_config(model_path: str, mode: str = "disaggregated", **sections: Any) -> dict[str, Any]:
    roles: dict[str, Any] = {"decode": {"replicas": 1, "resources": {"num_cpus": 1}}}
    if mode == "disaggregated":
        roles["prefill"] = {"replicas": 1, "resources": {"num_cpus": 1}}
    config = {
        "model": {"path": model_path},
        "served_model_name": "tiny",
        "engine": {"block_size": 16, "num_kv_blocks": 256, "max_num_batched_tokens": 512,
                   "max_num_seqs": 48, "device": "cpu"},
        "mode": mode,
        "roles": roles,
        "router": {"min_disaggregated_prompt_tokens": 16, "max_queued_requests": 64,
                   "request_timeout_s": 60},
        "handoff": {"auth_token": HANDOFF_TOKEN, "timeout_s": 20},
    }
    for name, section in sections.items():
        config[name] = config.get(name, {}) | section
    return config


def open_app_config(model_path: str) -> dict[str, Any]:
    """No API key; a small body limit and model length, so limits and fuzzing stay quick."""
    return edge_config(model_path, http={"max_body_bytes": OPEN_BODY_LIMIT},
                       model={"path": model_path, "max_model_len": OPEN_MAX_MODEL_LEN})


def keyed_app_config(model_path: str) -> dict[str, Any]:
    """One key in YAML; the fixture adds ENV_KEY through $PDSERVE_API_KEY."""
    return edge_config(model_path, mode="colocated", http={"api_keys": [YAML_KEY]})


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


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)
