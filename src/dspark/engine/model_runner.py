"""The target side of a step: build the flat batch (every admitted prompt for a prefill; each request's last token
and its planned drafts for a verify), run the target's forward over the KV cache, and keep or roll back the positions
a step wrote. It knows requests only by their tokens, positions and KV slots; the bookkeeping of requests (queues,
slots, finishing, emitting) is the engine's."""
from __future__ import annotations

import torch

from ..draft.tree import layout
from ..proposal import Proposal
from ..target.kv_cache import KVCache
from ..target.model import FlatBatch, TargetModel, TargetOutput


class ModelRunner:
    def __init__(self, target: TargetModel, cache: KVCache, capture_layers: tuple[int, ...]):
        self.target, self.cache, self.capture_layers = target, cache, capture_layers

    def forward(self, batch: FlatBatch) -> TargetOutput:
        self.target.capture_layers = self.capture_layers  # the target may be shared by several engines
        return self.target(batch, self.cache)

    def prefill(self, prompts: list[list[int]], slot_start: int, slots: int) -> tuple[FlatBatch, TargetOutput]:
        """Every prompt in one flat batch, in the slots from slot_start; `slots` slots are in use."""
        lens = [len(p) for p in prompts]
        self.cache.reserve(slots, max(lens) + 1)
        batch = FlatBatch(torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(n) for n in lens]),
                          lens, slot_start=slot_start, prefill=True)
        return batch, self.forward(batch)

    def verify(self, reqs: list, proposal: Proposal, lengths: torch.Tensor, slots: int,
               float_logits: bool) -> tuple[FlatBatch, TargetOutput, torch.Tensor]:
        """The verify forward: (batch, output, logits of every row: float32, or the target's dtype where only
        argmaxes are read)."""
        batch = self.verify_batch(reqs, proposal, lengths, slots)
        out = self.forward(batch)
        return batch, out, self.target.logits(out.hidden, torch.float32 if float_logits else None)

    def verify_batch(self, reqs: list, proposal: Proposal, lengths: torch.Tensor, slots: int) -> FlatBatch:
        """Each request's last token and its first lengths[r] drafts; a draft tree's rows hide the rows that are
        not their ancestors and are rotated at their depth (draft/tree.py)."""
        toks, pos, rotary, hidden = [], [], [], []
        parents = None if proposal.parents is None else proposal.parents.tolist()
        for r, (req, row, n) in enumerate(zip(reqs, proposal.tokens.tolist(), lengths.tolist())):
            toks += [req.last_token] + row[:n]
            pos += range(req.num_cached, req.num_cached + 1 + n)
            if parents is not None:
                depth, hides = layout(parents[r][:n])
                rotary += [req.num_cached + d for d in depth]
                hidden += hides
        self.cache.reserve(slots, max(pos) + 1)
        tree = {} if parents is None else {"rotary_positions": torch.tensor(rotary), "hidden": torch.tensor(hidden)}
        return FlatBatch(torch.tensor(toks), torch.tensor(pos), (1 + lengths).tolist(), slot_start=reqs[0].slot, **tree)

    def keep(self, slot: int, start: int, rows: list[int]) -> None:
        """Of the rows a forward wrote at positions start.., keep `rows` (in order) as start, start + 1, ..."""
        if rows and rows[-1] != len(rows) - 1:  # a walk off the first chain
            self.cache.keep(slot, start, rows)

    def copy_slot(self, source: int, dest: int, length: int) -> None:
        self.cache.copy_slot(source, dest, length)
