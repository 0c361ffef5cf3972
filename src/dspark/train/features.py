"""Target features for training, computed online: one batched target forward per batch of sequences gives
the drafter's context features (outputs of the chosen target layers) and the final hidden states, from
which the target's distributions p are computed locally with the LM head."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..target.kv_cache import KVCache
from ..target.model import FlatBatch, TargetModel


@dataclass
class SequenceFeatures:
    features: torch.Tensor  # [B, L, m*d] context features (zero past each sequence's end)
    hidden: torch.Tensor  # [B, L, d] final-normed hidden states
    lengths: list[int]
    lse: torch.Tensor | None = None  # [B, L] the target logits' log-normaliser at temperature 1 (from the cache)


def target_features(target: TargetModel, sequences: list[list[int]], layer_ids: tuple[int, ...]) -> SequenceFeatures:
    c = target.config
    lengths = [len(s) for s in sequences]
    cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, getattr(c, "head_dim", None) or
                    c.hidden_size // c.num_attention_heads, target.dtype, max(lengths), slots=len(sequences),
                    capacity=max(lengths))
    cache.num_used = len(sequences)
    batch = FlatBatch(torch.tensor([t for s in sequences for t in s]), torch.cat([torch.arange(n) for n in lengths]),
                      lengths, prefill=True)
    saved, target.capture_layers = target.capture_layers, tuple(layer_ids)
    try:
        out = target(batch, cache)  # inference mode inside; copied below into ordinary tensors
    finally:
        target.capture_layers = saved
    B, L = len(sequences), max(lengths)
    feats = out.features.new_zeros(B, L, out.features.shape[-1])
    hidden = out.hidden.new_zeros(B, L, out.hidden.shape[-1])
    feats[batch.query_valid] = out.features  # flat order is row-major over the valid [B, L] entries
    hidden[batch.query_valid] = out.hidden
    return SequenceFeatures(feats, hidden, lengths)
