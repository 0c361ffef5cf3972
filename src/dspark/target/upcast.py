"""Many-row products of bf16 weights computed in float32, for CPUs without a bf16 matrix unit.

On such CPUs (AVX2, or AVX-512 without BF16) PyTorch's bf16 matrix product costs about one single-row
product per row, while float32 products of many rows run at full speed. Measured on an AVX2 EPYC, 2 threads
(ad hoc): the default target's prefill of a 44-token prompt 333 -> 166 ms, of a 107-token prompt 778 -> 280 ms.
One-row products (plain decoding) are fastest in bf16, so this path is asked for only where rows are
many by nature: the engine's prefill of admitted prompts and target features for training (FlatBatch(prefill=True)).
Weights are converted CHUNK output rows at a time: no float32 copy of the model is kept.

Batch invariance: a row's result must not depend on which other rows share the product, or a request's
output would depend on what else was admitted with it. Float32 products of fewer than MIN_ROWS rows take a
different kernel whose rounding differs, so smaller inputs are padded to MIN_ROWS rows (tested).

Drafters take the path by row count (`ManyRowsLinear`, from FAST_ROWS rows): a drafter's q is returned exactly
as it was sampled from, so losslessness never needs it batch-invariant, and every drafting forward has G rows
per request.
"""
from __future__ import annotations

import torch
from torch import nn

from .onednn import linear

CHUNK = 1024
MIN_ROWS = 4
FAST_ROWS = 16


def cpu_bf16_unit() -> str:
    """Which bf16 matrix instructions the CPU has ("none" on AVX2 machines)."""
    units = [name for name, has in (("AMX", torch.cpu._is_amx_tile_supported()),
                                     ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported())) if has]
    return " + ".join(units) or "none"


UPCAST_HELPS = cpu_bf16_unit() == "none"


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the product in float32, returned in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n = rows.shape[0]
    if n < MIN_ROWS:
        rows = torch.cat((rows, rows.new_zeros(MIN_ROWS - n, rows.shape[1])))
    out = torch.cat([linear(rows, weight[i:i + CHUNK].float()) for i in range(0, weight.shape[0], CHUNK)], 1)[:n]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


class ManyRowsLinear(nn.Linear):
    """nn.Linear whose bf16 products of at least FAST_ROWS rows take the float32 path where that is faster."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if UPCAST_HELPS and self.weight.dtype == torch.bfloat16 and x.is_cpu and x.numel() >= FAST_ROWS * x.shape[-1]:
            return upcast_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
