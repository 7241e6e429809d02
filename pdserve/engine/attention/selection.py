"""Which attention backend a worker runs, and why: a pure rule over what the device, dtype and
block size allow, and the import probes that feed it.

flash-attn 2 when its paged kernel fits (Ampere or newer, fp16/bf16, block size a multiple of
256); else pdserve's Triton kernel on CUDA; else PyTorch (the CPU path, and CUDA without Triton).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.attention import cpu_native
from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.flash_backend import (
    FLASH_DTYPES,
    FLASH_MIN_CAPABILITY,
    FLASH_PAGED_BLOCK_MULTIPLE,
    FlashAttentionBackend,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendRule:
    """What the rule chose: a backend name ("flash-attn", "triton", "torch") and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class AttentionChoice:
    backend: AttentionBackend
    reason: str


def choose_backend(
    device_type: str,
    dtype: torch.dtype,
    block_size: int | None,
    capability: tuple[int, int] | None,
    flash_problem: str | None,
    triton_problem: str | None,
) -> BackendRule:
    """The rule itself, testable anywhere. ``block_size`` None: the cache's is not known yet,
    so only a backend that serves any will do. ``*_problem``: why that package cannot be used
    (None: it imports and has what pdserve calls)."""
    if device_type != "cuda":
        return BackendRule("torch", f"{device_type} device: PyTorch's kernels")
    not_flash = _why_not_flash(dtype, block_size, capability, flash_problem)
    if not_flash is None:
        return BackendRule("flash-attn", f"flash-attn's paged kernel fits (block size "
                           f"{block_size}, {dtype}, compute capability {capability})")
    if triton_problem is None:
        return BackendRule("triton", f"pdserve's Triton paged kernel, because {not_flash}")
    return BackendRule("torch", f"PyTorch SDPA, because {not_flash} and Triton is unusable "
                       f"({triton_problem})")


def _why_not_flash(dtype: torch.dtype, block_size: int | None,
                   capability: tuple[int, int] | None, flash_problem: str | None) -> str | None:
    if capability is None or capability < FLASH_MIN_CAPABILITY:
        has = "?" if capability is None else f"{capability[0]}.{capability[1]}"
        return f"flash-attn 2 needs compute capability >= 8.0 and this GPU has {has}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn does not run {dtype}"
    if block_size is None:
        return "no KV block size was given, and flash-attn's paged kernel serves only some"
    if block_size % FLASH_PAGED_BLOCK_MULTIPLE:
        return (f"flash-attn reads a paged cache only at block sizes that are multiples of "
                f"{FLASH_PAGED_BLOCK_MULTIPLE} (engine.block_size is {block_size})")
    return None if flash_problem is None else f"flash-attn is unusable ({flash_problem})"


def select_attention_backend(device: torch.device | str, dtype: torch.dtype,
                             block_size: int | None) -> AttentionChoice:
    """Probe the packages and the device, apply `choose_backend`, build the backend."""
    from pdserve.engine.attention.torch_backend import TorchAttentionBackend

    device = torch.device(device)
    capability = None
    flash_problem: str | None = "not probed off CUDA"
    triton_problem: str | None = "not probed off CUDA"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        flash_problem, triton_problem = probe_flash_attn(), probe_triton()
    rule = choose_backend(device.type, dtype, block_size, capability, flash_problem,
                          triton_problem)
    backend: AttentionBackend
    if rule.name == "flash-attn":
        backend = FlashAttentionBackend()
    elif rule.name == "triton":
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
    else:
        backend = TorchAttentionBackend()
        if device.type == "cpu" and dtype in cpu_native.DTYPES:
            # Built (or found cached) now, at start-up, not inside the first request's step.
            cpu_native.decode_kernel()
    logger.info("attention backend: %s (%s)", rule.name, rule.reason)
    return AttentionChoice(backend, rule.reason)


def probe_flash_attn() -> str | None:
    """Why flash-attn cannot be used here (None: it imports and reads a paged cache)."""
    try:
        import inspect

        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:  # counted in the reason, not hidden
        return f"it did not import: {exc}"
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return "its flash_attn_varlen_func takes no block_table (flash-attn >= 2.5 does)"
    return None


def probe_triton() -> str | None:
    """Why Triton cannot be used here (None: it imports)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"it did not import: {exc}"
    return None
