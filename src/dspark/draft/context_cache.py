"""What the feature-reading drafters share: their own KV cache of the projected target context, slot for
slot with the engine's cache. A request's committed positions are written at commit; draft positions are
written past the context at propose time and overwritten by later context."""
from __future__ import annotations

import torch

from ..target.kv_cache import KVCache
from ..target.model import FlatBatch, cached_attention
from .base import Drafter


class ContextCacheDrafter(Drafter):
    def __init__(self, model, max_model_len: int = 8192):
        self.model = model.eval().requires_grad_(False)
        self.gamma = model.block_size
        self.target_layer_ids = model.target_layer_ids
        c = model.c
        self.cache = KVCache(len(model.layers), c.num_key_value_heads, c.head_dim, model.dtype,
                             max_model_len + self.gamma)
        self.context_len: dict[str, int] = {}  # request id -> context positions in the drafter cache

    def attend(self, batch: FlatBatch):
        return lambda layer, q, k, v: cached_attention(layer, q, k, v, batch, self.cache)

    def store_context(self, req, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Append n positions of per-layer (keys, values) [n, KVH, hd] to the request's context."""
        start, n = self.context_len.get(req.request_id, 0), kv[0][0].shape[0]
        self.cache.reserve(req.slot + 1, start + n + self.gamma)
        positions = torch.arange(start, start + n)
        slots = torch.full_like(positions, req.slot)
        for layer, (k, v) in enumerate(kv):
            self.cache.store(layer, slots, positions, k, v)
        self.context_len[req.request_id] = start + n
        return positions

    def context_positions(self, req, n: int) -> torch.Tensor:
        start = self.context_len.get(req.request_id, 0)
        return torch.arange(start, start + n)

    @torch.inference_mode()  # the cache may have been allocated in inference mode (commit, propose)
    def release(self, request, moved_from: int | None = None) -> None:
        self.context_len.pop(request.request_id, None)
        if moved_from is not None:
            self.cache.copy_slot(moved_from, request.slot, self.cache.capacity)
