"""DSpark (and DFlash) behind the Drafter interface: one backbone forward drafts a block for every running
request, then the sequential head samples x_1..x_γ left to right from exactly the q it returns.

The drafter keeps its own KV cache of the projected context, slot for slot with the engine's cache: a
request's committed features are written at commit; block keys are written past the context at propose
time and overwritten by later context.
"""
from __future__ import annotations

import torch

from ..sampling import param_tensors, sample, warp
from ..target.kv_cache import KVCache
from ..target.model import FlatBatch, cached_attention
from .base import Drafter, Proposal
from .dspark_model import DSparkModel


class DSparkDrafter(Drafter):
    def __init__(self, model: DSparkModel, max_model_len: int = 8192):
        self.model = model.eval().requires_grad_(False)
        self.gamma = model.block_size
        self.target_layer_ids = model.target_layer_ids
        c = model.c
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.dtype,
                             max_model_len + self.gamma)
        self.context_len: dict[str, int] = {}  # request id -> context positions in the drafter cache

    def _attend(self, batch: FlatBatch):
        return lambda layer, q, k, v: cached_attention(layer, q, k, v, batch, self.cache)

    @torch.inference_mode()
    def commit(self, requests: list, features: list[torch.Tensor | None]) -> None:
        for req, feats in zip(requests, features):
            start = self.context_len.get(req.request_id, 0)
            n = feats.shape[0]
            self.cache.reserve(req.slot + 1, start + n + self.gamma)
            positions = torch.arange(start, start + n)
            h_ctx = self.model.context(feats)
            kv = self.model.context_kv(h_ctx, positions)
            slots = torch.full_like(positions, req.slot)
            for layer, (k, v) in enumerate(kv):
                self.cache.store(layer, slots, positions, k, v)
            self.context_len[req.request_id] = start + n

    @torch.inference_mode()
    def propose(self, requests: list) -> Proposal:
        R, G, m = len(requests), self.gamma, self.model
        anchors = torch.tensor([r.last_token for r in requests])
        starts = torch.tensor([self.context_len[r.request_id] for r in requests])
        block = m.block_inputs(anchors)  # [R, G]
        positions = (starts[:, None] + torch.arange(G)[None, :]).flatten()
        visible = (starts + G - 1).repeat_interleave(G)
        self.cache.reserve(requests[-1].slot + 1, int(visible.max()) + 1)
        batch = FlatBatch(block.flatten(), positions, [G] * R, slot_start=requests[0].slot, visible=visible)
        h = m.backbone(batch.tokens, positions, self._attend(batch)).view(R, G, -1)
        U = m.base_logits(h)  # [R, G, V]
        params = param_tensors([r.params for r in requests])
        u = torch.stack([r.uniforms(G) for r in requests])  # [R, G]
        tokens = torch.zeros(R, G, dtype=torch.long)
        q = torch.empty_like(U)
        conf = torch.ones(R, G)
        prev, state = anchors, m.markov_head.initial_state(R, h) if m.markov_head is not None else None
        for k in range(G):
            bias, c_logit, state = m.head_step(prev, h[:, k], state)
            q[:, k] = warp(U[:, k] if bias is None else U[:, k] + bias, *params)
            tokens[:, k] = prev = sample(q[:, k], u[:, k])
            if c_logit is not None:
                conf[:, k] = torch.sigmoid(c_logit.float())
        return Proposal(tokens, q, torch.full((R,), G), conf if m.confidence_head is not None else None)

    def release(self, request, moved_from: int | None = None) -> None:
        self.context_len.pop(request.request_id, None)
        if moved_from is not None:
            self.cache.copy_slot(moved_from, request.slot, self.cache.capacity)
