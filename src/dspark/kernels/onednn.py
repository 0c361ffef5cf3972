"""Float32 inference products on CPU through oneDNN rather than PyTorch's default float32 kernel.

PyTorch's F.linear sends float32 CPU products to MKL, which on AVX2 AMD CPUs runs few-row products far below
what the memory allows; on an AVX2 EPYC, 2 threads, oneDNN's inner product is the faster of the two for
SmolLM2-135M's products and its 49,152-row LM head at each row count tried, from 1 to 64. It reads the same
row-major weight (no packed copy, no extra memory), it has no slow row counts (MKL's 3-row head takes longer than
its 8-row head there), and a row's result does not depend on the other rows of the product once there are enough
of them (batch invariance: from 2 rows on the AVX2 EPYC, from 16 on an AVX-512 Intel Xeon; MKL's products of fewer
than 4 rows round differently). upcast.py pads where it needs invariance.

Only inference takes this path (the op has no backward): autograd products, as in drafter training, stay on
F.linear. bf16 weights keep F.linear (oneDNN's bf16 product needs AVX-512 or AVX-NE-CONVERT).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); float32 inference on CPU runs oneDNN's inner product."""
    if ONEDNN and x.dtype == weight.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
