"""Per-request KV caches in one preallocated tensor per layer: [slots, kv_heads, capacity, head_dim].

Active requests occupy slots 0..n-1 with no holes (freeing a slot moves the last one into it), so a
forward over requests in slot order reads a plain view of the cache. A request's committed length is
kept by its owner: rolling back rejected positions is only a smaller length, because attention never
reads past a query's own position and later writes overwrite the stale entries.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_len: int, slots: int = 4, capacity: int = 256):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.max_len = max_len
        self.num_used = 0
        self.k = self.v = None
        self._allocate(slots, min(capacity, max_len))

    def _allocate(self, slots: int, capacity: int):
        layers, heads, hd = self.shape
        k = torch.zeros(layers, slots, heads, capacity, hd, dtype=self.dtype)
        v = torch.zeros_like(k)
        if self.k is not None:
            s, c = self.k.shape[1], self.k.shape[3]
            k[:, :s, :, :c] = self.k
            v[:, :s, :, :c] = self.v
        self.k, self.v = k, v

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, slots: int, length: int):
        """Make room for `slots` slots of `length` positions (grows by doubling)."""
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the context of {self.max_len}")
        cur_slots, cur_cap = self.k.shape[1], self.capacity
        if slots <= cur_slots and length <= cur_cap:
            return
        new_slots = max(cur_slots, 1)
        while new_slots < slots:
            new_slots *= 2
        new_cap = cur_cap
        while new_cap < length:
            new_cap = min(2 * new_cap, self.max_len)
        self._allocate(new_slots, new_cap)

    def allocate(self) -> int:
        self.reserve(self.num_used + 1, 1)
        self.num_used += 1
        return self.num_used - 1

    def free(self, slot: int, last_length: int) -> int | None:
        """Free `slot`; the last slot (holding `last_length` positions) moves into it.

        Returns the slot that moved (its owner must take `slot`), or None.
        """
        last = self.num_used - 1
        self.num_used -= 1
        if slot == last:
            return None
        self.copy_slot(last, slot, last_length)
        return last

    def copy_slot(self, src: int, dst: int, length: int):
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def keep(self, slot: int, start: int, rows: list[int]):
        """Move positions start + rows[j] of `slot` to start + j (rows increasing: the walk a draft tree's
        verification accepted, draft/tree.py)."""
        src, dst = torch.tensor(rows) + start, torch.arange(len(rows)) + start
        self.k[:, slot, :, dst] = self.k[:, slot, :, src]
        self.v[:, slot, :, dst] = self.v[:, slot, :, src]

    def write(self, layer: int, batch, k: torch.Tensor, v: torch.Tensor):
        """Store the batch's new keys/values ([T, KVH, hd]) and return the batch's [R, KVH, L, hd] views."""
        self.store(layer, batch.slots, batch.positions, k, v)
        s0, s1 = batch.slot_start, batch.slot_start + batch.num_requests
        return self.k[layer, s0:s1, :, : batch.key_len], self.v[layer, s0:s1, :, : batch.key_len]

    def store(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Keys/values [T, KVH, hd] of token t go to slot slots[t] at position positions[t]."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v
