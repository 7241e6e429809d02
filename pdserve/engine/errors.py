"""Exceptions the engine raises, each with a message a user can act on.

The HTTP edge maps them to status codes; nothing here knows about HTTP.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """A checkpoint directory is missing files, has unreadable files, or disagrees with itself."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture is not one pdserve implements."""


class InvalidRequestError(EngineError):
    """A request the engine refuses as given (bad sampling params, empty prompt, ...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) exceeds the model's maximum length."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, detail: str = "") -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        extra = f" {detail}" if detail else ""
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens but the model's maximum length is "
            f"{max_model_len} tokens{extra}"
        )


class OutOfKVBlocksError(EngineError):
    """A request can never fit: it needs more KV blocks than the whole cache has."""


class EngineDeadError(EngineError):
    """The engine thread crashed; the worker must be restarted."""


class InconsistentKVError(EngineError):
    """A request's KV and tokens do not come from one computation (blocks that do not cover
    its prompt, output tokens before its first): it stops with this error instead of
    sampling from them."""
