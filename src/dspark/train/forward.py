"""The drafters' teacher-forced forwards over packed anchors, returning q's logits, confidence logits and the
target's p at the same positions. DSpark/DFlash: the backbone on every block at once, then the sequential
head left to right with the target's own tokens as x_{k-1}. Eagle3-style/MTP: γ unrolled steps, each
feeding its hidden state to the next (Eagle3's training-time test). With a draft vocabulary (TrainingVocab) the
drafter's logits, W2 and the target's logits are its columns only."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..draft.draft_vocab import TrainingVocab
from ..draft.dspark_model import DSparkModel
from ..draft.eagle3_model import Eagle3Model
from ..target.model import TargetModel
from .anchors import AnchorBatch, dense_attend
from .features import SequenceFeatures
from .losses import dspark_loss


@dataclass
class BlockOutputs:
    """q_k = softmax(U + u W2ᵀ) and p_k = softmax(t / temperature) of M = B*N blocks, kept as the LM heads
    wrote them (the loss forms each row in float32 only as it needs it). V is the vocabulary's size, or over a
    draft vocabulary its size: U, W2 and t hold its columns, labels index it and p there sums to at most 1."""
    U: torch.Tensor  # [M, γ, V] the drafter's logits before the Markov bias
    markov: tuple[torch.Tensor, torch.Tensor] | None  # (u [M, γ, r], W2 [V, r]) or None
    conf_logits: torch.Tensor | None  # [M, γ]
    t: torch.Tensor  # [M, γ, V] the target's logits
    labels: torch.Tensor  # [M, γ]
    valid: torch.Tensor  # [M]
    temperature: float = 1.0
    lse: torch.Tensor | None = None  # [M, γ] over a draft vocabulary: t / T's log-normaliser over the whole one

    @property
    def logits(self) -> torch.Tensor:
        """q's logits [M, γ, V] in float32 (for inspection)."""
        z = self.U.float()
        return z if self.markov is None else z + self.markov[0].float() @ self.markov[1].float().t()

    @property
    def p(self) -> torch.Tensor:
        """The target's probabilities [M, γ, V] in float32 (for inspection; over a draft vocabulary its columns of
        the whole distribution)."""
        x = self.t.float() / self.temperature
        return x.softmax(-1) if self.lse is None else (x - self.lse[..., None]).exp()

    def loss(self):
        return dspark_loss(self.U, self.t, self.labels, self.conf_logits, self.valid, self.temperature, self.markov,
                           self.lse)


def target_side(target: TargetModel, tokens: torch.Tensor, feats: SequenceFeatures, anchors: AnchorBatch,
                vocab: TrainingVocab | None, temperature: float):
    """The target's logits [M, γ, V] (its own dtype), own tokens x_{a+k} [M, γ] for every block, and None; over a
    draft vocabulary its columns, indices into it, and the log-normaliser [M, γ] of t / T (read from the feature
    cache where it holds one, at temperature 1: then only the vocabulary's rows of the LM head run)."""
    B, L = tokens.shape
    rows = anchors.rows()
    bidx = torch.arange(B)[:, None, None]
    hidden = feats.hidden[bidx, rows].reshape(-1, feats.hidden.shape[-1])
    labels = tokens[bidx, (rows + 1).clamp(max=L - 1)].flatten()
    lse = None
    if vocab is not None and feats.lse is not None and temperature == 1.0:
        t, labels, lse = vocab.head(hidden), vocab.index[labels], feats.lse[bidx, rows].flatten()
    else:
        t = target.logits(hidden, dtype=None)
        if vocab is not None:
            t, labels, lse = vocab.columns(t, labels, temperature)
    M = B * rows.shape[1]
    return t.view(M, anchors.block_size, -1), labels.view(M, -1), None if lse is None else lse.view(M, -1)


def forward_for(model) -> callable:
    return eagle3_forward if isinstance(model, Eagle3Model) else block_forward


def block_forward(model: DSparkModel, target: TargetModel, tokens: torch.Tensor, feats: SequenceFeatures,
                  anchors: AnchorBatch, temperature: float = 1.0, vocab: TrainingVocab | None = None) -> BlockOutputs:
    """tokens [B, L] (padded); feats from target_features over the same sequences."""
    B, L = tokens.shape
    G = model.block_size
    rows = anchors.rows()  # [B, N, γ] positions a..a+γ-1
    N = rows.shape[1]
    bidx = torch.arange(B)[:, None, None]
    t, labels, lse = target_side(target, tokens, feats, anchors, vocab, temperature)
    prev = tokens[bidx, rows].reshape(B * N, G)  # x_{a+k-1}; x_a is the anchor
    h_ctx = model.context(feats.features.reshape(B * L, -1))
    ctx_pos = torch.arange(L).repeat(B)
    ctx_kv = [(k.view(B, L, *k.shape[1:]), v.view(B, L, *v.shape[1:])) for k, v in model.context_kv(h_ctx, ctx_pos)]
    block = torch.full((B, N, G), model.mask_token_id, dtype=torch.long)
    block[..., 0] = tokens[bidx[..., 0], anchors.anchors]
    h = model.backbone(block.flatten(), rows.flatten(), dense_attend(ctx_kv, anchors.mask(L)))
    h = h.view(B * N, G, -1)
    U = model.base_logits(h, dtype=None, head=None if vocab is None else vocab.head)  # [M, γ, V]
    state = model.markov_head.initial_state(B * N, h) if model.markov_head is not None else None
    us, confs = [], []
    for k in range(G):
        u, c, state = model.head_inputs(prev[:, k], h[:, k], state)
        us.append(u)
        confs.append(c)
    markov = None
    if us[0] is not None:
        w2 = model.markov_head.markov_w2.weight
        markov = (torch.stack(us, 1), w2 if vocab is None else vocab.rows(w2))
    conf = torch.stack(confs, 1) if confs[0] is not None else None
    return BlockOutputs(U, markov, conf, t, labels, anchors.valid.flatten(), temperature, lse)


def unrolled_attend(ctx_kv: tuple[torch.Tensor, torch.Tensor], ctx_mask: torch.Tensor):
    """Attention for step k of N blocks per sequence: each block's query sees the context before its anchor
    ([B, N, L] mask) and the keys of its own steps 1..k, which accumulate across calls."""
    ck, cv = ctx_kv  # [B, L, KVH, hd]
    B, N, _ = ctx_mask.shape
    steps_k, steps_v = [], []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        steps_k.append(k.view(B, N, *k.shape[1:]))
        steps_v.append(v.view(B, N, *v.shape[1:]))
        n = len(steps_k)
        own = torch.eye(N, dtype=torch.bool).repeat_interleave(n, 1)  # [N, N*n]
        mask = torch.cat([ctx_mask, own[None].expand(B, -1, -1)], -1)[:, None]
        keys = torch.cat([ck, torch.stack(steps_k, 2).flatten(1, 2)], 1).transpose(1, 2)
        values = torch.cat([cv, torch.stack(steps_v, 2).flatten(1, 2)], 1).transpose(1, 2)
        qb = q.view(B, N, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(B * N, -1)
    return attend


def eagle3_forward(model: Eagle3Model, target: TargetModel, tokens: torch.Tensor, feats: SequenceFeatures,
                   anchors: AnchorBatch, temperature: float = 1.0, vocab: TrainingVocab | None = None) -> BlockOutputs:
    """Step k reads x_{a+k-1} (the target's own token) and the previous step's hidden state (g_{a-1} for
    the first), at position a+k-1; the context holds x_t with g_{t-1} for t < a."""
    B, L = tokens.shape
    rows = anchors.rows()
    bidx = torch.arange(B)[:, None]
    t, labels, lse = target_side(target, tokens, feats, anchors, vocab, temperature)
    g = model.fuse(feats.features.reshape(B * L, -1)).view(B, L, -1)
    g_prev = torch.cat([g.new_zeros(B, 1, g.shape[-1]), g[:, :-1]], 1)
    (k, v), = model.context_kv(tokens.flatten(), g_prev.flatten(0, 1), torch.arange(L).repeat(B))
    ctx_mask = torch.arange(L)[None, None, :] < anchors.anchors[..., None]
    attend = unrolled_attend((k.view(B, L, *k.shape[1:]), v.view(B, L, *v.shape[1:])), ctx_mask)
    h = g_prev[bidx, anchors.anchors].flatten(0, 1)  # [M, d]
    logits = []
    for step in range(model.block_size):
        pos = rows[..., step]
        h = model.step(tokens[bidx, pos].flatten(), h, pos.flatten(), attend)
        logits.append(model.draft_logits(h, dtype=None, head=None if vocab is None else vocab.head))
    return BlockOutputs(torch.stack(logits, 1), None, None, t, labels, anchors.valid.flatten(), temperature, lse)
