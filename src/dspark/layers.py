"""The layers the target and the drafters share: Linear (through the product kernel the forward chose), RMSNorm,
rotary position tables and their application."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.groups import Groups
from .kernels.onednn import linear
from .kernels.skinny import skinny_linear, tiles


class Linear(nn.Linear):
    """nn.Linear through the kernel upcast.product_kernel chose for the forward (default: onednn.py's choice);
    skinny.py's kernel reads the weight's GGUF groups where it has them (groups.py: the same result) and its copy
    packed for AMX's tiles where the CPU has them (skinny.tiles)."""

    groups: Groups | None = None

    def forward(self, x: torch.Tensor, product=linear) -> torch.Tensor:
        if product is skinny_linear:
            if self.groups is not None:
                return self.groups(x, self.bias)
            return skinny_linear(x, self.weight, self.bias, packed=tiles(self))
        return product(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does, then scaled in the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for token positions; inverse frequencies from transformers' rope functions."""

    def __init__(self, config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [T, 1, hd] and the sign-folded sin, so that rotary(x) = x * cos + roll(x, hd/2) * sin."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, hd/2) * sign-folded sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
