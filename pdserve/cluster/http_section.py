"""The config section of the HTTP listener: address, front end, drain, stalled streams, body
limit and API keys (each key checked for length and spaces)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from pdserve.cluster.config_sections import MIN_TOKEN_CHARS, Section


class HttpSection(Section):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds; 0.0.0.0 (or a "
                      "host's address) serves other machines, and then api_keys should be set.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the HTTP server.")
    frontend: Literal["direct", "proxy"] = Field(
        "direct", description="direct: the ingress replica serves HTTP itself on `port` "
        "(Serve's direct ingress, no proxy hop per token); proxy: Serve's HTTP proxy serves "
        "`port` and forwards to the ingress. Applies where `pdserve serve` starts Ray.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM: how long open requests may finish (new ones get "
        "503) before the rest are ended with an error event.")
    stalled_stream_timeout_s: float = Field(
        5.0, gt=0, description="A stream whose client has taken none of its output for this "
        "long (the server's send stayed blocked on full socket buffers: the client stopped "
        "reading, or reads less than about 48 KiB in this time) is ended: its admission slot, "
        "KV blocks and buffered output are freed and it counts as status stalled.")
    max_unsent_stream_bytes: int = Field(
        8 << 20, ge=64 << 10, description="A stream whose output waiting for its client (its "
        "tokens, text and logprobs as received) passes this many bytes is ended the same way, "
        "before stalled_stream_timeout_s.")
    max_body_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body accepted: a larger "
        "Content-Length is answered 413 before the body is read, and a streamed (chunked) body "
        "is answered 413 as soon as it grows past this. 4 MiB holds a ~500k-token ASCII prompt "
        "(JSON escapes make non-ASCII text up to 6x longer); raise it for longer contexts.")
    api_keys: list[SecretStr] = Field(
        default_factory=list, description="Bearer tokens the HTTP API accepts (Authorization: "
        "Bearer KEY); the environment variable PDSERVE_API_KEY adds one (or several, comma "
        "separated). None here and none there: no authentication. GET /health stays open.")
    metrics_require_api_key: bool = Field(
        True, description="Whether GET /metrics needs an API key too (when keys are set); false "
        "lets a Prometheus scraper in without one.")

    @field_validator("api_keys")
    @classmethod
    def _long_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for key in keys:
            check_api_key(key.get_secret_value())
        return keys


def check_api_key(key: str) -> str:
    """An API key worth having: long enough not to be guessed, no spaces (a header value)."""
    if len(key) < MIN_TOKEN_CHARS or any(c.isspace() for c in key):
        raise ValueError(f"an API key needs at least {MIN_TOKEN_CHARS} characters and no "
                         "spaces; make one with: python -c 'import secrets; "
                         "print(secrets.token_urlsafe(24))'")
    return key
