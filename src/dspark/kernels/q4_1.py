"""4-bit weights in GGUF's Q4_1 layout (groups of 32 along the input: w = q·d + m, q ∈ 0..15), multiplied by
PyTorch's packed int4 CPU kernel with bf16 activations.

The bundled target *is* Q4_1 (every projection of every layer), so quantizing its dequantized weights again
finds the same q, d and m: the layers read 4.5 bits per weight instead of bf16's 16, so one-token steps cost less
than in bf16. Products of many rows are bound by their multiply-adds rather than by the weights' bytes, and there
bf16 (on a matrix unit, or upcast.py's float32 path on bf16 weights) is faster, so verify forwards of many tokens,
and long prefills, are slower in q4_1 than in bf16 (benchmarks/results/engine_speed.md: verify step time, ms bf16
against ms q4_1, on a 2-core AMX Xeon).
The embedding and the LM head (Q8_0 in the GGUF) stay bf16. Any other target is quantized to 4 bits by the
same rule (llama.cpp's reference Q4_1), which changes its weights: say so when you report numbers."""
from __future__ import annotations

import torch
from torch import nn

GROUP = 32


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int32 in 0..15, d [N, K/32], m [N, K/32]), llama.cpp's reference rule: d =
    (max − min)/15 and m = min per group, both rounded to float16 as the GGUF stores them."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((w - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.view(n, k), d, m


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, k // GROUP, GROUP).float() * d[..., None] + m[..., None]).view(n, k)


class Q4Linear(nn.Module):
    """y = x Wᵀ + b with W held as packed 4-bit groups; the kernel's offset form is w = (q − 8)·d + (m + 8d)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, d, m = quantize_q4_1(linear.weight.detach())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        scale_zero = torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor, product=None) -> torch.Tensor:
        """The forward's product kernel (upcast.product_kernel) is ignored: the int4 kernel serves every row count."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                                       self.packed, GROUP, self.scale_zero)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4_1 groups of {GROUP}"


def quantize_layers(model: nn.Module) -> int:
    """Replace every nn.Linear inside `model.layers` whose input width is a multiple of 32 by a Q4Linear;
    returns how many were replaced. The embedding and the LM head are left as they are."""
    count = 0
    for layer in model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear) and module.in_features % GROUP == 0:
                parent_name, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent_name) if parent_name else layer, child, Q4Linear(module))
                count += 1
    return count
