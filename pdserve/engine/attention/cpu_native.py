"""pdserve's C decode-attention kernel for CPU (`cpu_decode.c`): built once per machine with
its C compiler, loaded through ctypes, run on torch's OpenMP threads.

The kernel reads each sequence's K/V blocks where the cache holds them; the PyTorch path
gathers and re-lays them out twice per layer first. Without a C compiler (or when the build
fails) the PyTorch path runs, and the log says why once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.native_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
# The limits of the kernel's fixed scratch arrays (cpu_decode.c).
MAX_HEAD_DIM, MAX_HEADS, MAX_QUERY_FLOATS, MAX_BLOCK = 512, 64, 16384, 128
DTYPES = (torch.float32, torch.bfloat16)
# Reassociation lets the compiler split the kernel's reductions (1.30 -> 0.85 ms a layer at 32
# rows of ~240 tokens, bf16, with the vectorizable exp); it assumes nothing about inf or NaN,
# which the softmax relies on. -fopenmp shares the rows among torch's OpenMP threads (0.44 ms
# a layer at two threads, 0.84 at one; Python threads beside torch's spinning OpenMP workers
# measured slower than one thread).
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fPIC", "-shared")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class DecodeItems:
    """A step's decode rows for the kernel: row i is the sequence at ``seqs[i]`` of the block
    table and lengths, whose query and output sit at token row ``rows[i]``."""

    seqs: torch.Tensor  # int64 [n]
    rows: torch.Tensor  # int64 [n]
    block_tables: torch.Tensor  # int32 [S, max_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [S]

    @property
    def count(self) -> int:
        return int(self.seqs.shape[0])


class DecodeKernel:
    """The loaded kernel: one C call per layer, holding no GIL, its rows shared among torch's
    intra-op threads (the same OpenMP runtime)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        args = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                _I64, _I64, _I64, ctypes.c_float, ctypes.c_int, _PTR, _I64, _I64]
        self._alone = library.pdserve_decode_attention
        self._shared = library.pdserve_decode_attention_shared
        for fn, argtypes in ((self._alone, args), (self._shared, [*args, ctypes.c_int])):
            fn.restype, fn.argtypes = ctypes.c_int, argtypes

    @staticmethod
    def fits(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int) -> bool:
        return (dtype in DTYPES and num_heads % num_kv_heads == 0 and num_heads <= MAX_HEADS
                and head_dim <= MAX_HEAD_DIM and num_heads * head_dim <= MAX_QUERY_FLOATS
                and block_size <= MAX_BLOCK)

    def attend(self, query: torch.Tensor, layer_cache: torch.Tensor, items: DecodeItems,
               out: torch.Tensor, scale: float) -> None:
        """``out[rows[i]] = attention(query[rows[i]])`` for every item: ``query`` and ``out``
        ``[T, heads, head_dim]`` with a contiguous last dimension; ``layer_cache``
        ``[2, blocks, block_size, kv_heads, head_dim]`` contiguous."""
        if query.stride(2) != 1 or out.stride(2) != 1 or not layer_cache.is_contiguous():
            raise ValueError("decode kernel: query/out rows and the cache must be contiguous")
        _, _, block_size, kv_heads, head_dim = layer_cache.shape
        args = (query.data_ptr(), query.stride(0), query.stride(1), layer_cache[0].data_ptr(),
                layer_cache[1].data_ptr(), items.block_tables.data_ptr(),
                items.block_tables.stride(0), items.seq_lens.data_ptr(), items.seqs.data_ptr(),
                items.rows.data_ptr(), 0, items.count, query.shape[1], kv_heads, head_dim,
                block_size, scale, int(query.dtype == torch.bfloat16), out.data_ptr(),
                out.stride(0), out.stride(1))
        threads = torch.get_num_threads()
        code = self._alone(*args) if threads == 1 else self._shared(*args, threads)
        if code:
            raise ValueError(f"decode kernel: sizes past its limits ({query.shape[1]} heads, "
                             f"{kv_heads} KV heads, head_dim {head_dim}, block {block_size})")


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The kernel for this machine, built on first use (None: it cannot be; logged once)."""
    library = load_library(SOURCE, _FLAGS, logger,
                           "CPU decode attention: PyTorch's ops run instead")
    return DecodeKernel(library) if library is not None else None
