"""The DSpark training loss (docs/method.md): L = 0.1 CE + 0.9 TV + 1.0 confidence-BCE, each summed over
block positions with weights w_k = exp(-(k-1)/γ) and averaged over blocks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "conf": 1.0}
CHUNK = 8  # rows of [N, V] per pass: 8 x 49,152 float32 values (1.5 MB) stay in a core's L2 cache


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


class RowTerms(torch.autograd.Function):
    """Per row n: CE -log q[label] and ‖q - p‖₁, with q = softmax(U + u W2ᵀ) (u W2ᵀ the Markov head's
    low-rank bias, absent for other drafters) and p = softmax(t / T) from the target's logits t, CHUNK rows
    at a time.

    Over a draft vocabulary (draft_vocab.TrainingVocab) U and t hold only its columns and `lse` [N] is the
    log-normaliser of t / T over the whole vocabulary: p there is exp(t / T - lse), the target's mass outside
    it (where q is zero) adds to ‖q - p‖₁ as a constant, and a label outside it (-1) has no CE.

    U and t arrive in the LM head's dtype (bf16 on the default target) and no [N, V] tensor is made in
    float32: each chunk's z, q and p (1.5 MB each) are formed, used and dropped. The plain autograd graph
    made about a dozen passes over [N, V] float32 tensors each way (896 rows of 49,152 per step), most of
    them writes into freshly allocated memory. The backward recomputes a chunk's q and p and writes
    dz = q ⊙ (g_tv (s - <q, s>) + g_ce) - g_ce e_label with s = sign(q - p) (the subgradient 0 where q = p,
    as autograd's abs) into dU, du = dz W2 and dW2 = Σ dzᵀ u."""

    @staticmethod
    def forward(ctx, U, t, labels, temperature: float, u=None, w2=None, lse=None):
        with torch.autocast("cpu", enabled=False):  # the chunks in float32 whatever the caller's autocast
            dtype = torch.promote_types(U.dtype, torch.float32)
            ce, l1 = (U.new_empty(U.shape[0], dtype=dtype) for _ in range(2))
            inside = labels >= 0
            for i in range(0, U.shape[0], CHUNK):
                z, p = chunk_logits(U, u, w2, i, dtype), chunk_probs(t, temperature, i, dtype, lse)
                z_lse = z.logsumexp(-1, keepdim=True)
                label_z = z.gather(-1, labels[i:i + CHUNK, None].clamp(min=0))
                ce[i:i + CHUNK] = ((z_lse - label_z).squeeze(-1)).where(inside[i:i + CHUNK], 0.0)
                outside = 0.0 if lse is None else (1 - p.sum(-1)).clamp_(min=0)
                l1[i:i + CHUNK] = z.sub_(z_lse).exp_().sub_(p).abs_().sum(-1) + outside
        ctx.save_for_backward(U, labels, u, w2)
        ctx.t, ctx.temperature, ctx.lse = t, temperature, lse  # t, lse: from the frozen target (inference tensors)
        return ce, l1

    @staticmethod
    def backward(ctx, g_ce, g_l1):
        U, labels, u, w2 = ctx.saved_tensors
        dU = torch.empty_like(U)
        bias_grad = u is not None and (ctx.needs_input_grad[4] or ctx.needs_input_grad[5])
        du = torch.zeros_like(u) if bias_grad else None
        dw2 = torch.zeros_like(w2, dtype=g_ce.dtype) if bias_grad else None
        for i in range(0, U.shape[0], CHUNK):
            q = chunk_logits(U, u, w2, i, g_ce.dtype).softmax(-1)
            s = (q - chunk_probs(ctx.t, ctx.temperature, i, g_ce.dtype, ctx.lse)).sign_()
            label = labels[i:i + CHUNK, None]
            gc, gl = g_ce[i:i + CHUNK, None] * (label >= 0), g_l1[i:i + CHUNK, None]
            gz = q.mul_(gl * (s - (q * s).sum(-1, keepdim=True)) + gc)
            gz.scatter_add_(-1, label.clamp(min=0), -gc)
            dU[i:i + CHUNK] = gz
            if bias_grad:
                du[i:i + CHUNK] = gz @ w2.to(gz.dtype)
                dw2.addmm_(gz.t(), u[i:i + CHUNK].to(gz.dtype))
        return dU, None, None, None, du, None if dw2 is None else dw2.to(w2.dtype), None


def chunk_logits(U, u, w2, i: int, dtype: torch.dtype) -> torch.Tensor:
    """z = U + u W2ᵀ of rows i..i+CHUNK in `dtype` (a new tensor)."""
    z = U[i:i + CHUNK].to(dtype, copy=True)
    return z if u is None else z.addmm_(u[i:i + CHUNK].to(dtype), w2.t().to(dtype))


def chunk_probs(t, temperature: float, i: int, dtype: torch.dtype, lse=None) -> torch.Tensor:
    """p = softmax(t / T) of rows i..i+CHUNK in `dtype`; exp(t / T - lse) with the whole vocabulary's
    log-normaliser `lse` when t holds a draft vocabulary's columns."""
    x = t[i:i + CHUNK].to(dtype)
    x = x if temperature == 1.0 else x / temperature
    return x.softmax(-1) if lse is None else (x - lse[i:i + CHUNK, None].to(dtype)).exp_()


def dspark_loss(U: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, conf_logits: torch.Tensor | None,
                valid: torch.Tensor, temperature: float = 1.0, markov: tuple | None = None,
                lse: torch.Tensor | None = None) -> LossParts:
    """U [M, γ, V] the drafter's logits before the Markov bias; t [M, γ, V] the target's logits (p = softmax(t /
    temperature)); labels [M, γ] the target's own tokens; conf_logits [M, γ] or None; valid [M] blocks that
    count; markov: (u [M, γ, r], W2 [V, r]) of the bias u W2ᵀ, or None. Over a draft vocabulary V is its
    size, labels are indices into it (-1 outside) and lse [M, γ] is t / T's log-normaliser over the whole
    vocabulary (RowTerms)."""
    M, G, V = U.shape
    w = position_weights(G)
    u, w2 = (markov[0].flatten(0, 1), markov[1]) if markov is not None else (None, None)
    ce, l1 = (x.view(M, G) for x in RowTerms.apply(U.reshape(M * G, V), t.reshape(M * G, V), labels.flatten(),
                                                   temperature, u, w2, None if lse is None else lse.flatten()))
    c_star = (1 - 0.5 * l1).detach().clamp(0, 1)
    conf = (F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
            if conf_logits is not None else torch.zeros_like(ce))
    n = valid.sum().clamp(min=1)  # a position whose label lies outside a draft vocabulary counts with CE 0
    mean = lambda x: ((x * w).sum(-1) * valid).sum() / n  # noqa: E731
    ce_l, tv_l, conf_l = mean(ce), mean(l1), mean(conf)
    total = LOSS_WEIGHTS["ce"] * ce_l + LOSS_WEIGHTS["tv"] * tv_l + LOSS_WEIGHTS["conf"] * conf_l
    accept = (c_star * valid[:, None]).sum(0) / n
    tau = ((1 + c_star.cumprod(-1).sum(-1)) * valid).sum() / n
    return LossParts(total, ce_l, tv_l, conf_l, accept, tau, valid.sum())
