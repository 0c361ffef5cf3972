"""DSpark (and DFlash) behind the Drafter interface: one backbone forward drafts a block for every running
request, then the sequential head samples x_1..x_γ left to right from exactly the q it returns (a step of greedy
requests takes each argmax and returns no q: point masses)."""
from __future__ import annotations

import torch

from ..sampling import mend, param_tensors, sample, warp
from ..kernels.argmax import argmax_rows
from ..kernels.fused_layers import fused_forward, fused_weights
from ..target.model import FlatBatch
from ..proposal import Proposal
from .context_cache import ContextCacheDrafter
from .draft_vocab import token_ids, widen
from .dspark_model import DSparkModel
from .inference_heads import InferenceHeads


class DSparkDrafter(ContextCacheDrafter):
    """temperatures: STS temperatures T_1..T_γ applied to the confidences, c_k = σ(logit_k / T_k); offline_ece: the
    ECE they reached where they were fitted (calibration.json), which online calibration takes as given."""

    model: DSparkModel

    def __init__(self, model: DSparkModel, max_model_len: int = 8192, temperatures: list[float] | None = None,
                 offline_ece: float | None = None):
        super().__init__(model, max_model_len)
        if temperatures is not None and len(temperatures) != self.gamma:
            raise ValueError(f"{len(temperatures)} calibration temperatures for a block of {self.gamma}")
        self.temperatures, self.offline_ece = temperatures, offline_ece
        self.has_confidence = model.confidence_head is not None

    def project(self, requests, tokens, features, positions):
        return self.model.context_kv(self.model.context(torch.cat(features)), torch.cat(positions))

    def backbone(self, batch: FlatBatch) -> torch.Tensor:
        """h [T, d] of the block tokens: the model's backbone, its layers in one call to fused_layers.cpp where that
        runs them (as the target's decode and verify forwards: the block's keys and values written to this
        drafter's cache before attention reads them, as the layer loop writes them)."""
        m = self.model
        if (weights := fused_weights(m, batch)) is None:
            return m.backbone(batch.tokens, batch.positions, self.attend(batch))
        x = m.embed_tokens(batch.tokens).to(m.dtype)
        cos, sin = m.rotary(batch.positions, x.dtype)
        fused_forward(m, weights, x, cos, sin, batch, self.cache)
        return m.norm(x)

    @torch.inference_mode()
    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        R, G, m = len(requests), self.gamma, self.model
        K = G if limit is None else max(0, min(G, limit))  # positions sampled (the block itself stays whole)
        if K == 0:
            return Proposal.empty(R)
        self.flush()
        anchors = torch.tensor([r.last_token for r in requests])
        starts = torch.tensor([self.context_len[r.request_id] for r in requests])
        block = m.block_inputs(anchors)  # [R, G]
        positions = (starts[:, None] + torch.arange(G)[None, :]).flatten()
        visible = (starts + G - 1).repeat_interleave(G)
        self.cache.reserve(requests[-1].slot + 1, int(visible.max()) + 1)
        batch = FlatBatch(block.flatten(), positions, [G] * R, slot_start=requests[0].slot, visible=visible)
        h = self.backbone(batch).view(R, G, -1)
        U = m.base_logits(h[:, :K])  # [R, K, V], or [R, K, |draft vocabulary|]
        params = param_tensors([r.params for r in requests])
        u = torch.stack([r.uniforms(G) for r in requests])  # [R, G]: γ per step whatever K, so seeds replay
        tokens = torch.zeros(R, K, dtype=torch.long)
        greedy = all(r.params.greedy for r in requests)  # then q is a point mass on each argmax: returned as None
        q = None if greedy else torch.empty_like(U)
        conf = torch.ones(R, K)
        lengths = torch.full((R,), K)
        temps = self.temperatures or [1.0] * G
        prev, state = anchors, m.markov_head.initial_state(R, h) if m.markov_head is not None else None
        heads = InferenceHeads.of(m)
        conf_h = heads.block_confidence(h[:, :K])
        for k in range(K):
            bias, c_logit, state = heads.step(prev, h[:, k], state, None if conf_h is None else conf_h[:, k])
            logits = U[:, k] if bias is None else U[:, k] + bias
            if greedy:
                choice = argmax_rows(logits)
            else:
                q[:, k] = warp(logits, *params)
                choice = mend(sample(q[:, k], u[:, k]), lengths, k)
            tokens[:, k] = prev = token_ids(choice, m.draft_ids)
            if c_logit is not None:
                conf[:, k] = torch.sigmoid(c_logit.float() / temps[k])
        return Proposal(tokens, None if greedy else widen(q, m.draft_ids, m.c.vocab_size), lengths,
                        conf if m.confidence_head is not None else None)
