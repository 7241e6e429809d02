"""The rules a request is held to: admission checks and the stop rules after each token.

Pure functions of a request and the limits; the scheduler applies them.
"""

from __future__ import annotations

from collections.abc import Container

from pdserve.engine.errors import InvalidRequestError, OutOfKVBlocksError, PromptTooLongError
from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.scheduler_output import SchedulerConfig


def stop_status(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The finished status that ``token_id`` (just appended) puts the request in, if any.

    A stop token wins over a length limit reached by the same token ("stop", not "length").
    """
    params = request.sampling_params
    if token_id in params.stop_token_ids or (
        not params.ignore_eos and token_id in request.eos_token_ids
    ):
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def max_kv_tokens(request: Request, max_model_len: int) -> int:
    """Most tokens whose KV the request can ever hold (the last sampled token has none)."""
    if request.mode is RequestMode.PREFILL_ONLY:
        return request.num_tokens
    final_len = request.num_prompt_tokens + request.sampling_params.max_tokens
    return max(request.num_tokens, min(final_len, max_model_len) - 1)


def check_new_request(
    request: Request, config: SchedulerConfig, kv: KVCacheManager, live_ids: Container[str]
) -> None:
    """Raise unless the request is new, unique, shorter than the model and could ever fit.

    `PromptTooLongError` names both lengths; `OutOfKVBlocksError` says how many blocks the
    request could need against the whole cache's.
    """
    if request.request_id in live_ids:
        raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
        raise InvalidRequestError(
            f"request {request.request_id} is not new (status {request.status.name}, "
            f"{request.num_computed_tokens} computed tokens)"
        )
    if request.num_prompt_tokens >= config.max_model_len:
        raise PromptTooLongError(
            request.num_prompt_tokens,
            config.max_model_len,
            "(the prompt must be shorter to leave room for output)",
        )
    num_tokens = max_kv_tokens(request, config.max_model_len)
    num_needed = kv.num_blocks_for(num_tokens)
    if num_needed > kv.num_blocks:
        raise OutOfKVBlocksError(
            f"request {request.request_id} needs up to {num_needed} KV blocks "
            f"({num_tokens} tokens, block size {kv.block_size}) but the whole cache has "
            f"{kv.num_blocks}; shorten the prompt or max_tokens, or give the engine more "
            "KV cache memory"
        )
