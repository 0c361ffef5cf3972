"""Each row's argmax through argmax.cpp: greedy decoding reads nothing else of the logits. Over a verify forward's
bf16 logits (rows of 49,152) PyTorch's argmax costs about a twentieth of an 8-token forward on a 2-core Xeon with AMX,
argmax.cpp a small fraction of that (benchmarks/results/tiles.md: argmax, forward and attention). The same index as
torch.argmax (the first largest value; a NaN counts as the largest); where the kernel is not built, torch.argmax
runs."""
from __future__ import annotations

import ctypes
import functools

import torch

from .skinny import kernel

FUNCTIONS = {torch.bfloat16: "argmax_bf16", torch.float32: "argmax_f32"}


@functools.cache
def entry(lib: ctypes.CDLL, dtype: torch.dtype):
    function = getattr(lib, FUNCTIONS[dtype])
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    function.restype = None
    return function


def argmax_rows(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x.argmax(-1) for x [N, V] (`lib`: a kernel built for other instructions than `kernel()`)."""
    lib = lib or kernel()
    if lib is None or x.dim() != 2 or x.dtype not in FUNCTIONS or not x.is_cpu or x.shape[1] == 0:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    entry(lib, x.dtype)(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
