"""What the feature-reading drafters share: their own KV cache of the projected target context, slot for
slot with the engine's cache. Draft positions are written past the context at propose time and
overwritten by later context.

Committed positions are projected lazily: `commit` only queues a request's new tokens and target features,
and the queue is projected in one batched forward over every queued request when the drafter next proposes,
or once some request has FLUSH_ROWS positions queued (which bounds the queue's memory). A step whose
scheduler skips the drafter so costs the drafter nothing, and a step that drafts projects all its requests'
new positions in one product instead of one small product per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..target.kv_cache import KVCache
from ..target.model import FlatBatch, cached_attention
from .base import Drafter

FLUSH_ROWS = 32


@dataclass
class Queued:
    """A request's committed positions waiting to be projected."""
    request: object
    tokens: list = field(default_factory=list)  # [n_i] tensors, in commit order
    features: list = field(default_factory=list)  # [n_i, m*d] tensors
    rows: int = 0  # total queued positions


class ContextCacheDrafter(Drafter):
    def __init__(self, model, max_model_len: int = 8192):
        self.model = model.eval().requires_grad_(False)
        self.gamma = model.block_size
        self.target_layer_ids = model.target_layer_ids
        c = model.c
        self.cache = KVCache(len(model.layers), c.num_key_value_heads, c.head_dim, model.dtype,
                             max_model_len + self.gamma)
        self.context_len: dict[str, int] = {}  # request id -> projected context positions in the drafter cache
        self.pending: dict[str, Queued] = {}  # request id -> its positions not yet projected

    def project(self, requests: list, tokens: list[torch.Tensor], features: list[torch.Tensor],
                positions: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter layer (keys, values) [N, KVH, hd] of the requests' new context positions, concatenated
        in request order (each request's tokens [n_r], features [n_r, m*d] and positions [n_r])."""
        raise NotImplementedError

    def attend(self, batch: FlatBatch):
        return lambda layer, q, k, v: cached_attention(layer, q, k, v, batch, self.cache, exact=False)

    @torch.inference_mode()
    def commit(self, requests: list, tokens: list[torch.Tensor], features: list[torch.Tensor]) -> None:
        longest = 0
        for req, toks, feats in zip(requests, tokens, features):
            queued = self.pending.setdefault(req.request_id, Queued(req))
            queued.tokens.append(toks)
            queued.features.append(feats)
            queued.rows += len(toks)
            longest = max(longest, queued.rows)
        if longest >= FLUSH_ROWS:
            self.flush()

    @torch.inference_mode()
    def flush(self) -> None:
        """Project every queued position into the cache (one batched forward)."""
        if not self.pending:
            return
        queue = list(self.pending.values())  # kept queued until stored: a failure leaves them for the next try
        reqs = [q.request for q in queue]
        starts = [self.context_len.get(r.request_id, 0) for r in reqs]
        ends = [s + q.rows for s, q in zip(starts, queue)]
        positions = [torch.arange(s, e) for s, e in zip(starts, ends)]
        kv = self.project(reqs, [torch.cat(q.tokens) for q in queue], [torch.cat(q.features) for q in queue],
                          positions)
        slots = torch.cat([torch.full((q.rows,), r.slot) for r, q in zip(reqs, queue)])
        self.cache.reserve(max(r.slot for r in reqs) + 1, max(ends) + self.gamma)
        for layer, (k, v) in enumerate(kv):
            self.cache.store(layer, slots, torch.cat(positions), k, v)
        self.pending = {}
        for req, end in zip(reqs, ends):
            self.context_len[req.request_id] = end

    def committed_len(self, request_id: str) -> int:
        """Context positions committed so far, projected or queued."""
        queued = self.pending.get(request_id)
        return self.context_len.get(request_id, 0) + (queued.rows if queued else 0)

    @torch.inference_mode()  # the cache may have been allocated in inference mode (commit, propose)
    def release(self, request, moved_from: int | None = None) -> None:
        self.context_len.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
        if moved_from is not None:
            self.cache.copy_slot(moved_from, request.slot, self.cache.capacity)
