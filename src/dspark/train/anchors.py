"""Anchors sampled per training sequence and packed: every anchor a opens one block (x_a, mask, ..., mask)
at positions a..a+γ-1 whose γ outputs predict x_{a+1}..x_{a+γ}. A block reads the context features of
positions < a and its own block bidirectionally, exactly what it sees at inference."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AnchorBatch:
    anchors: torch.Tensor  # [B, N] anchor positions (padding anchors repeat a valid one)
    valid: torch.Tensor  # [B, N] bool
    block_size: int

    @property
    def offsets(self) -> torch.Tensor:
        return torch.arange(self.block_size)

    def rows(self) -> torch.Tensor:
        """[B, N, γ] sequence positions a + k - 1, k = 1..γ: where p_k and the block queries sit."""
        return self.anchors[..., None] + self.offsets

    def mask(self, ctx_len: int) -> torch.Tensor:
        """[B, 1, Nγ, L + Nγ]: block queries see context keys < anchor and keys of their own block."""
        B, N = self.anchors.shape
        G = self.block_size
        ctx = torch.arange(ctx_len)[None, None, :] < self.anchors[..., None]  # [B, N, L]
        ctx = ctx[:, :, None, :].expand(B, N, G, ctx_len).reshape(B, N * G, ctx_len)
        own = torch.block_diag(*[torch.ones(G, G, dtype=torch.bool)] * N)[None].expand(B, -1, -1)
        return torch.cat([ctx, own], -1)[:, None]


def sample_anchors(lengths: list[int], starts: list[int], num_anchors: int, block_size: int,
                   generators: list[torch.Generator]) -> AnchorBatch:
    """Up to num_anchors distinct anchors per sequence in [start, length - 1 - γ] (start: first anchor
    allowed, e.g. the last prompt token), sorted; sequences with none get one padding anchor."""
    per_seq = []
    for n, s, generator in zip(lengths, starts, generators):
        hi = n - 1 - block_size
        cand = torch.arange(s, hi + 1) if hi >= s else torch.zeros(0, dtype=torch.long)
        pick = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort().values
        per_seq.append(pick)
    N = max(1, max(len(p) for p in per_seq))
    anchors = torch.zeros(len(lengths), N, dtype=torch.long)
    valid = torch.zeros(len(lengths), N, dtype=torch.bool)
    for i, pick in enumerate(per_seq):
        anchors[i, :len(pick)], valid[i, :len(pick)] = pick, True
        anchors[i, len(pick):] = pick[-1] if len(pick) else 0
    return AnchorBatch(anchors, valid, block_size)


def dense_attend(ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor):
    """The training counterpart of cached attention: block queries [B*Nγ, H, hd] over [context; block]
    keys. ctx_kv[layer] = (keys, values) [B, L, KVH, hd]; mask [B, 1, Nγ, L + Nγ]."""
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = ctx_kv[layer]
        B = ck.shape[0]
        q = q.view(B, -1, *q.shape[1:]).transpose(1, 2)
        keys = torch.cat([ck, k.view(B, -1, *k.shape[1:])], 1).transpose(1, 2)
        values = torch.cat([cv, v.view(B, -1, *v.shape[1:])], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[3])
    return attend
