"""float32 weights held losslessly as the GGUF's own groups, for few-row products (decode and verify forwards).

The bundled target comes from a GGUF whose layers are Q4_1 (groups of 32 along the input: w = d·q + m, q in
0..15, d and m float16) and whose embedding, the tied LM head, is Q8_0 (w = d·q, q in -127..127). Its float32
weights are exactly those dequantized values, so they can be held in those groups again (5 and 8.5 bits per weight
instead of 32) and decoded inside skinny.cpp's float32 tiles to the very same float32 values: the products, and
so the whole forward, are bit-identical to the float32 forward over the dense weights (tested), while a one-token
forward reads about a sixth of the bytes, and its products take a fraction of the dense float32 time. The gain
shrinks with the rows because the float32 multiply-adds themselves take the time there; decoding each weight once
into a buffer for more than 4 rows, instead of once per tile of 4 rows, is slower still, so the tiles decode in
place.

A weight is held in groups only if its float32 values are found again bit for bit (`hold_groups` checks every
group), which holds for weights that came from such a GGUF and practically never otherwise: other targets, and
bf16, keep the dense products. The dense weights stay for prefills and products of more rows. Options.groups=False
turns this off.

Drafters' LM heads are held in the nearest Q8_0 groups whatever their dtype (`hold_head_groups`; not exact, and
need not be: a drafter's q is what it returns and samples from, so drafting stays lossless). A drafter call one
position deep (the async scheduler's short drafts) multiplies one row per request by the whole head, in bf16 56 MB
for SmolLM2's 49,152 x 576. Q8_0 groups read about half those bytes, which pays while the rows fit one 4-row tile;
past it the groups are decoded twice and the bf16 head is as fast or faster, so up to HEAD_ROWS rows read the
groups. For the bundled target they are the GGUF's own values, of which its bf16 head is a rounding.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from .. import options
from .q4_1 import GROUP
from .skinny import kernel

KINDS = {  # kind: (product, packing function, the packed tensors' dtypes and widths per group of 32 weights)
    "q4_1": ("skinny_q4_1_f32", "group_q4_1", ((torch.uint8, 16), (torch.float32, 1), (torch.float32, 1))),
    "q8_0": ("skinny_q8_0_f32", "group_q8_0", ((torch.int8, 32), (torch.float32, 1))),
}


class Groups:
    """A float32 weight [N, K] as GGUF groups (skinny.cpp's Q4_1 or Q8_0 layout), multiplied by its group tiles."""

    def __init__(self, kind: str, tensors: tuple[torch.Tensor, ...], out_features: int, in_features: int):
        self.kind, self.tensors = kind, tensors
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def of(cls, weight: torch.Tensor, lib: ctypes.CDLL | None = None, exact: bool = True) -> "Groups | None":
        """The weight in Q4_1 or Q8_0 groups if they give back its float32 values exactly, else None;
        exact=False: the nearest Q8_0 groups whatever they give back (any float weight, any grid)."""
        if weight.dim() != 2 or weight.shape[1] % GROUP or (exact and weight.dtype != torch.float32):
            return None
        n, k = weight.shape
        weight = weight.float().contiguous()
        for kind, (_, pack, layout) in KINDS.items() if exact else [("q8_0", KINDS["q8_0"])]:
            tensors = tuple(torch.empty(n, k // GROUP * width, dtype=dtype) for dtype, width in layout)
            fn = getattr(lib or kernel(), pack)
            fn.argtypes = [ctypes.c_void_p] * (1 + len(tensors)) + [ctypes.c_int64] * 2 + [ctypes.c_int]
            if fn(weight.data_ptr(), *(t.data_ptr() for t in tensors), n, k, torch.get_num_threads()) or not exact:
                return cls(kind, tensors, n, k)
        return None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, lib: ctypes.CDLL | None = None
                 ) -> torch.Tensor:
        """x [..., K] @ Wᵀ + bias for float32 x of at most skinny.MAX_ROWS rows (where skinny_linear would run)."""
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        fn = getattr(lib or kernel(), KINDS[self.kind][0])
        fn.argtypes = [ctypes.c_void_p] * (len(self.tensors) + 3) + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn(rows.data_ptr(), *(t.data_ptr() for t in self.tensors), None if bias is None else bias.data_ptr(),
           out.data_ptr(), rows.shape[0], self.out_features, self.in_features, torch.get_num_threads())
        return out.view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def hold_groups(model: nn.Module) -> int:
    """Give every float32 nn.Linear of `model` whose weight is exactly on a Q4_1 or Q8_0 grid its `groups`;
    returns how many. Nothing where Options.groups=False or skinny.cpp is not built; the first weight that is not on
    a grid stops the search (a target is on one grid or on none)."""
    if not options.current().groups or kernel() is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
            module.groups = Groups.of(module.weight.detach())
            if module.groups is None:
                break
            count += 1
    return count


HEAD_ROWS = 4  # a drafter's LM head reads its Q8_0 groups up to this many rows (see above)


def hold_head_groups(head: nn.Linear) -> bool:
    """Give a drafter's frozen LM head the nearest Q8_0 groups of its weight (see above); False where it cannot
    (Options.groups=False, skinny.cpp not built, a width that is no multiple of 32)."""
    if not options.current().groups or kernel() is None:
        return False
    head.groups = Groups.of(head.weight.detach(), exact=False)
    return head.groups is not None
