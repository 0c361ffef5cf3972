"""The target's exact distribution over the first few tokens after a prompt, as a tree of next-token
distributions, and a drafter that samples from a different distribution built from the same tree.

`TargetTree` runs the target once per likely prefix (prompt + up to depth - 1 tokens; the prompt prefilled as
the engine admits it, the prefix run on its cache as the engine verifies) and keeps, per prefix, its TOP tokens
of largest logit with their probabilities under the request's sampling settings (warp, exactly what plain
decoding samples from). Its cells partition all token sequences of length depth:
a sequence falls into the leaf of its longest expanded prefix, or into that prefix's "rest" cell.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.draft.base import Drafter
from dspark.proposal import Proposal
from dspark.sampling import SamplingParams, param_tensors, sample, warp
from dspark.target.kv_cache import KVCache
from dspark.target.model import FlatBatch

TOP = 512  # tokens kept per prefix; the rest of its mass is one cell
REST = -1  # the token of a prefix's "rest" cell
CHUNK = 256  # prefixes per target forward


@dataclass
class Node:
    tokens: torch.Tensor  # [TOP] the prefix's tokens of largest logit
    logits: torch.Tensor  # [TOP] their raw logits (float32)
    probs: np.ndarray  # [TOP] their target probabilities under the sampling settings (float64)

    def __post_init__(self):
        self.members = set(self.tokens.tolist())

    @property
    def rest(self) -> float:
        return max(0.0, 1.0 - float(self.probs.sum()))


class PrefixLogits:
    """Logits after the prompt followed by each of many prefixes, computed along the engine's path: the prompt
    prefilled once (`FlatBatch(prefill=True)`, the engine's admission; batch-invariant, tested in test_upcast),
    its cache copied into every slot, then the prefixes' tokens in one plain forward per CHUNK prefixes, reading
    the prompt's cached keys (the engine's verify forwards). Rows are grouped differently from the engine's steps,
    which in bf16 moves only the last bits of a logit: a reference of whole-sequence plain forwards passed the
    real-model tests against the engine on the plain path; the same reference against an engine admitting on the
    prefill path failed the top-p test (p = 0), so the prompt must take the engine's path."""

    def __init__(self, model, prompt_ids: list[int], depth: int):
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.model, self.P = model, len(prompt_ids)
        n = self.P + depth
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, head_dim, model.dtype, n, CHUNK, n)
        self.cache.allocate()
        batch = FlatBatch(torch.tensor(prompt_ids), torch.arange(self.P), [self.P], prefill=True)
        self.first = model.logits(model(batch, self.cache).hidden[batch.last_index])  # [1, V]
        for _ in range(1, CHUNK):
            self.cache.copy_slot(0, self.cache.allocate(), self.P)

    def __call__(self, prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        """Logits [n, V] after prompt + each prefix (all prefixes of one length)."""
        if prefixes == [()]:
            return self.first
        k = len(prefixes[0])
        assert all(len(p) == k for p in prefixes), "one forward per prefix length"
        out = []
        for i in range(0, len(prefixes), CHUNK):
            chunk = prefixes[i:i + CHUNK]
            batch = FlatBatch(torch.tensor([t for s in chunk for t in s]),
                              torch.arange(self.P, self.P + k).repeat(len(chunk)), [k] * len(chunk))
            out.append(self.model.logits(self.model(batch, self.cache).hidden[batch.last_index]))
        return torch.cat(out)


class TargetTree:
    def __init__(self, model, prompt_ids: list[int], params: SamplingParams, samples: int, depth: int = 3,
                 min_expected: float = 5.0):
        """Expand every prefix shorter than depth whose expected count in `samples` draws reaches
        min_expected."""
        self.params, self.depth = params, depth
        self.nodes: dict[tuple[int, ...], Node] = {}
        prefix_logits = PrefixLogits(model, prompt_ids, depth)
        level, mass = [()], [1.0]
        while level:
            logits = prefix_logits(level)
            probs = warp(logits, *param_tensors([params] * len(level)))
            top_logits, top_tokens = logits.topk(TOP, dim=-1)
            next_level, next_mass = [], []
            for i, prefix in enumerate(level):
                node_probs = probs[i, top_tokens[i]].double().numpy()
                self.nodes[prefix] = Node(top_tokens[i], top_logits[i], node_probs)
                if len(prefix) + 1 < depth:
                    for t, p in zip(top_tokens[i].tolist(), node_probs):
                        if samples * mass[i] * p >= min_expected:
                            next_level.append(prefix + (t,))
                            next_mass.append(mass[i] * p)
            level, mass = next_level, next_mass

    def cells(self) -> tuple[list[tuple[int, ...]], np.ndarray]:
        """All cells and their exact probabilities (summing to 1)."""
        keys, probs = [], []

        def visit(prefix, mass):
            node = self.nodes[prefix]
            for t, p in zip(node.tokens.tolist(), node.probs):
                if prefix + (t,) in self.nodes:
                    visit(prefix + (t,), mass * p)
                else:
                    keys.append(prefix + (t,))
                    probs.append(mass * p)
            keys.append(prefix + (REST,))
            probs.append(mass * node.rest)

        visit((), 1.0)
        probs = np.array(probs)
        return keys, probs / probs.sum()

    def cell_of(self, tokens: list[int]) -> tuple[int, ...]:
        """The cell of a sequence of `depth` tokens."""
        prefix = ()
        for t in tokens:
            if t not in self.nodes[prefix].members:
                return prefix + (REST,)
            if prefix + (t,) not in self.nodes:
                return prefix + (t,)
            prefix += (t,)
        raise ValueError(f"{tokens} is shorter than the tree's depth {self.depth}")


class TreeDrafter(Drafter):
    """One draft per request from q = warp(the target's TOP logits after the context, `temperature`,
    the request's top-p and top-k): a real distribution unlike p (zero outside the TOP tokens, other
    temperature), sampled with the request's generator. Contexts the tree lacks get no draft."""

    gamma = 1

    def __init__(self, tree: TargetTree, vocab_size: int, temperature: float):
        self.tree, self.vocab_size, self.temperature = tree, vocab_size, temperature

    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        R = len(requests)
        tokens = torch.zeros(R, 1, dtype=torch.long)
        q = torch.zeros(R, 1, self.vocab_size)
        lengths = torch.zeros(R, dtype=torch.long)
        rows = [i for i, r in enumerate(requests) if tuple(r.output_ids) in self.tree.nodes]
        if rows:
            nodes = [self.tree.nodes[tuple(requests[i].output_ids)] for i in rows]
            params = [SamplingParams(self.temperature, requests[i].params.top_p, requests[i].params.top_k) for i in rows]
            q_top = warp(torch.stack([n.logits for n in nodes]), *param_tensors(params))
            picks = sample(q_top, torch.cat([requests[i].uniforms(1) for i in rows]))
            idx = torch.tensor(rows)
            top_tokens = torch.stack([n.tokens for n in nodes])
            q[idx, 0] = q.new_zeros(len(rows), self.vocab_size).scatter(-1, top_tokens, q_top)
            tokens[idx, 0] = top_tokens.gather(-1, picks[:, None]).squeeze(1)
            lengths[idx] = 1
        return Proposal(tokens, q, lengths)
