"""Many-row products of bf16 weights computed in float32, for CPUs without a bf16 matrix unit.

On such CPUs (AVX2, or AVX-512 without BF16) PyTorch's bf16 matrix product costs about one single-row product per
row, while float32 products of many rows run at full speed; converting the weights to float32 costs about as much as
a few one-row bf16 products, so the path pays from several rows on. On an AMD EPYC without a bf16 unit,
benchmarks/results/upcast_rows.md has a verify forward after 200 cached tokens at 1.11x with the path for one
request of 7 tokens, 0.988x for 7 requests of one token, and from 1.18x (8 requests of one token) to 1.91x (16
tokens of one request) at 8 rows or more; hence MANY_ROWS = 7. So the target's forwards take this path where rows
are many: every prefill of admitted prompts and target features for training (FlatBatch(prefill=True)), and verify
forwards and LM heads of at least MANY_ROWS rows; one-row products (plain decoding of one request) stay in bf16,
where they are fastest. Weights are converted CHUNK output rows at a time: no float32 copy of the model is kept.

Batch invariance: a prefill row's result must not depend on which other rows share the product, or a
request's output would depend on what else was admitted with it. oneDNN's float32 products of few rows take a
different kernel whose rounding differs (on the AMD EPYCs, AVX2 and Zen 5, padding to 4 rows suffices; an
AVX-512 Intel Xeon changes kernel at 16 rows), so smaller inputs are padded to MIN_ROWS rows (tested). A
verify forward takes the path by its total row count, so in bf16 a request's logits may move in the last bit
with the number of tokens verified beside it (bf16 greedy outputs are reported, not promised, equal; float32
and CPUs with a bf16 unit never take the path).

Drafters take the path by row count (`ManyRowsLinear`, from FAST_ROWS rows): a drafter's q is returned exactly
as it was sampled from, so losslessness never needs it batch-invariant, and every drafting forward has G rows
per request.

`product_kernel` makes the one choice among the three kernels (skinny.py's for few rows, this path, onednn.py's)
for the target's forwards and the drafters' products alike.
"""
from __future__ import annotations

import torch
from torch import nn

from .groups import HEAD_ROWS
from .onednn import linear
from .skinny import kernel, skinny_linear, takes_skinny, tiles

CHUNK = 1024
MIN_ROWS = 16
MANY_ROWS = 7  # target verify forwards and LM heads (see above)
FAST_ROWS = 16


def cpu_bf16_unit() -> str:
    """Which bf16 matrix instructions the CPU has ("none" on AVX2 machines)."""
    units = [name for name, has in (("AMX", torch.cpu._is_amx_tile_supported()),
                                     ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported())) if has]
    return " + ".join(units) or "none"


UPCAST_HELPS = cpu_bf16_unit() == "none"


def takes_upcast(x: torch.Tensor, prefill: bool = False, rows: int | None = None) -> bool:
    """Whether bf16 products over x [..., d] take the float32 path: on CPUs without a bf16 unit, for a
    prefill or at least `rows` rows (default MANY_ROWS)."""
    many = x.numel() >= (rows or MANY_ROWS) * x.shape[-1]
    return UPCAST_HELPS and x.dtype == torch.bfloat16 and x.is_cpu and (prefill or many)


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


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) with float32 products of exactly MIN_ROWS rows each (the last block padded), so a
    row's result depends on nothing else: exactness where skinny.cpp is not built (PyTorch's kernels only)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n = rows.shape[0]
    blocks = torch.cat((rows, rows.new_zeros(-n % MIN_ROWS, rows.shape[1]))).split(MIN_ROWS)
    parts = []
    for i in range(0, weight.shape[0], CHUNK):
        w = weight[i:i + CHUNK].float()
        parts.append(torch.cat([linear(block, w) for block in blocks]))
    out = torch.cat(parts, 1)[:n]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def product_kernel(x: torch.Tensor, weight: torch.Tensor, prefill: bool = False, rows: int | None = None,
                   exact: bool = False):
    """The kernel of products over x [..., d]: skinny.py's for few rows outside prefill (for any rows where `exact`:
    its every output sums in one order whatever the rows, the target's contract under Options.exact), this module's
    float32 path for a prefill or at least `rows` rows (default MANY_ROWS) of bf16 weights where that is faster,
    else onednn.py's choice; where `exact` and skinny.cpp is not built, `blocked_linear`. The target chooses once
    per forward, so a token's products do not depend on the layer."""
    if (exact or not prefill) and takes_skinny(x, weight, any_rows=exact):
        return skinny_linear
    if exact and x.is_cpu and not torch.is_grad_enabled():
        return blocked_linear
    return upcast_linear if takes_upcast(x, prefill, rows) else linear


class ManyRowsLinear(nn.Linear):
    """nn.Linear through `product_kernel`, taking the float32 path from FAST_ROWS rows; a drafter's LM head with
    Q8_0 `groups` (groups.py) reads them for inference products of up to HEAD_ROWS rows. Inputs are made
    contiguous first: PyTorch's bf16 F.linear over a strided view (a drafter's first K of γ positions, [R, K, d])
    can take a path many times slower than over a contiguous copy (on an AVX-512 BF16 EPYC, for a 49,152-row
    head)."""

    groups = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if (self.groups is not None and x.numel() <= HEAD_ROWS * x.shape[-1] and not torch.is_grad_enabled()
                and kernel() is not None):
            return self.groups(x.float(), None if self.bias is None else self.bias.float()).to(x.dtype)
        product = product_kernel(x, self.weight, rows=FAST_ROWS)
        if product is skinny_linear:
            return skinny_linear(x, self.weight, self.bias, packed=tiles(self))
        return product(x, self.weight, self.bias)
