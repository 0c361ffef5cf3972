"""The DSpark training loss (METHOD.md §3): L = 0.1 CE + 0.9 TV + 1.0 confidence-BCE, each summed over
block positions with weights w_k = exp(-(k-1)/γ) and averaged over blocks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "conf": 1.0}


@dataclass
class LossParts:
    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    accept: torch.Tensor  # [γ] mean c*_k = 1 - ½‖q_k - p_k‖₁ (expected acceptance per position)
    tau: torch.Tensor  # expected acceptance length 1 + Σ_k Π_{i<=k} c*_i, averaged over blocks
    blocks: torch.Tensor  # number of valid blocks the averages are over


def position_weights(gamma: int) -> torch.Tensor:
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / gamma)


def dspark_loss(logits: torch.Tensor, p: torch.Tensor, labels: torch.Tensor, conf_logits: torch.Tensor | None,
                valid: torch.Tensor) -> LossParts:
    """logits [M, γ, V] of q; p [M, γ, V] target probabilities; labels [M, γ] the target's own tokens;
    conf_logits [M, γ] or None; valid [M] blocks that count."""
    M, G, _ = logits.shape
    w = position_weights(G)
    logq = logits.float().log_softmax(-1)
    q = logq.exp()
    ce = -logq.gather(-1, labels[..., None]).squeeze(-1)  # [M, γ]
    l1 = (q - p).abs().sum(-1)  # ‖q_k - p_k‖₁
    c_star = (1 - 0.5 * l1).detach().clamp(0, 1)
    conf = (F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
            if conf_logits is not None else torch.zeros_like(ce))
    n = valid.sum().clamp(min=1)
    mean = lambda x: ((x * w).sum(-1) * valid).sum() / n  # noqa: E731
    ce_l, tv_l, conf_l = mean(ce), mean(l1), mean(conf)
    total = LOSS_WEIGHTS["ce"] * ce_l + LOSS_WEIGHTS["tv"] * tv_l + LOSS_WEIGHTS["conf"] * conf_l
    accept = (c_star * valid[:, None]).sum(0) / n
    tau = ((1 + c_star.cumprod(-1).sum(-1)) * valid).sum() / n
    return LossParts(total, ce_l, tv_l, conf_l, accept, tau, valid.sum())
