"""The Eagle3-style drafter (and MTP-1) behind the Drafter interface: γ sequential one-layer forwards, each
feeding its hidden state and sampled token to the next; every draft is sampled from exactly the q returned."""
from __future__ import annotations

import torch

from ..sampling import mend, param_tensors, sample, warp
from ..target.model import FlatBatch
from ..proposal import Proposal
from .context_cache import ContextCacheDrafter
from .draft_vocab import token_ids, widen
from .eagle3_model import Eagle3Model


class Eagle3Drafter(ContextCacheDrafter):
    model: Eagle3Model

    def __init__(self, model: Eagle3Model, max_model_len: int = 8192):
        super().__init__(model, max_model_len)
        self.last_g: dict[str, torch.Tensor] = {}  # request id -> fused feature of its newest context position

    def project(self, requests, tokens, features, positions):
        g = self.model.fuse(torch.cat(features))
        ends = torch.tensor([len(t) for t in tokens]).cumsum(0)
        # g_prev: each request's own previous fused feature (g_{-1} = 0 at position 0)
        firsts = [self.last_g.get(r.request_id, g.new_zeros(1, g.shape[1])) for r in requests]
        g_prev = torch.cat([x for first, part in zip(firsts, g.tensor_split(ends[:-1].tolist()))
                            for x in (first, part[:-1])])
        kv = self.model.context_kv(torch.cat(tokens), g_prev, torch.cat(positions))
        for req, end in zip(requests, ends.tolist()):  # only once projected: a failure leaves them as they were
            self.last_g[req.request_id] = g[end - 1:end]
        return kv

    @torch.inference_mode()
    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        R, G, m = len(requests), self.gamma, self.model
        K = G if limit is None else max(0, min(G, limit))
        if K == 0:
            return Proposal.empty(R)
        self.flush()
        prev = torch.tensor([r.last_token for r in requests])
        positions = torch.tensor([self.context_len[r.request_id] for r in requests])
        g = torch.cat([self.last_g[r.request_id] for r in requests])
        self.cache.reserve(requests[-1].slot + 1, int(positions.max()) + G)
        params = param_tensors([r.params for r in requests])
        u = torch.stack([r.uniforms(G) for r in requests])
        tokens = torch.zeros(R, K, dtype=torch.long)
        q = torch.empty(R, K, m.c.vocab_size if m.draft_ids is None else len(m.draft_ids))
        lengths = torch.full((R,), K)
        for k in range(K):
            batch = FlatBatch(prev, positions + k, [1] * R, slot_start=requests[0].slot)
            g = m.step(prev, g, batch.positions, self.attend(batch))
            q[:, k] = warp(m.draft_logits(g), *params)
            tokens[:, k] = prev = token_ids(mend(sample(q[:, k], u[:, k]), lengths, k), m.draft_ids)
        return Proposal(tokens, widen(q, m.draft_ids, m.c.vocab_size), lengths)

    def release(self, request, moved_from: int | None = None) -> None:
        super().release(request, moved_from)
        self.last_g.pop(request.request_id, None)
