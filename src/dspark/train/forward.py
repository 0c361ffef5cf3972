"""The drafter's teacher-forced forward over packed anchors: backbone on every block at once, then the
sequential head left to right with the target's own tokens as x_{k-1}; returns q's logits, confidence
logits and the target's p at the same positions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..draft.dspark_model import DSparkModel
from ..target.model import TargetModel
from .anchors import AnchorBatch, dense_attend
from .features import SequenceFeatures


@dataclass
class BlockOutputs:
    logits: torch.Tensor  # [M, γ, V] logits of q_k (M = B*N blocks)
    conf_logits: torch.Tensor | None  # [M, γ]
    p: torch.Tensor  # [M, γ, V] target probabilities
    labels: torch.Tensor  # [M, γ]
    valid: torch.Tensor  # [M]


def block_forward(model: DSparkModel, target: TargetModel, tokens: torch.Tensor, feats: SequenceFeatures,
                  anchors: AnchorBatch, temperature: float = 1.0) -> BlockOutputs:
    """tokens [B, L] (padded); feats from target_features over the same sequences."""
    B, L = tokens.shape
    G = model.block_size
    rows = anchors.rows()  # [B, N, γ] positions a..a+γ-1
    N = rows.shape[1]
    bidx = torch.arange(B)[:, None, None]
    p = (target.logits(feats.hidden[bidx, rows].reshape(-1, feats.hidden.shape[-1])) / temperature).softmax(-1).clone()
    labels = tokens[bidx, (rows + 1).clamp(max=L - 1)]  # x_{a+k}
    prev = tokens[bidx, rows]  # x_{a+k-1}; x_a is the anchor
    h_ctx = model.context(feats.features.reshape(B * L, -1))
    ctx_pos = torch.arange(L).repeat(B)
    ctx_kv = [(k.view(B, L, *k.shape[1:]), v.view(B, L, *v.shape[1:])) for k, v in model.context_kv(h_ctx, ctx_pos)]
    block = torch.full((B, N, G), model.mask_token_id, dtype=torch.long)
    block[..., 0] = tokens[bidx[..., 0], anchors.anchors]
    h = model.backbone(block.flatten(), rows.flatten(), dense_attend(ctx_kv, anchors.mask(L)))
    h = h.view(B * N, G, -1)
    U = model.base_logits(h)  # [M, γ, V]
    prev = prev.reshape(B * N, G)
    state = model.markov_head.initial_state(B * N, h) if model.markov_head is not None else None
    biases, confs = [], []
    for k in range(G):
        bias, c, state = model.head_step(prev[:, k], h[:, k], state)
        biases.append(bias)
        confs.append(c)
    logits = U if biases[0] is None else U + torch.stack(biases, 1)
    conf = torch.stack(confs, 1) if confs[0] is not None else None
    return BlockOutputs(logits, conf, p.view(B * N, G, -1), labels.reshape(B * N, G), anchors.valid.flatten())
