"""Lossless verification, every verdict of the step: chain rejection sampling over a ragged batch (docs/method.md),
its greedy form from row argmaxes, and the greedy walk down a draft tree (draft/tree.py lays trees out).

Request r verifies the first lengths[r] of its drafts (0 = plain decoding). Its target distributions
sit in rows starts[r] .. starts[r] + lengths[r] of the flat p: row starts[r] + k is the target's
distribution for draft k + 1 (after the committed prefix and drafts 1..k). Draft k + 1 is accepted with
probability min(1, p(x)/q(x)); at the first rejection one token is drawn from norm(max(0, p - q));
if every verified draft passes, the bonus token is drawn from p at the next row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [R] accepted drafts
    next_token: torch.Tensor  # [R] correction or bonus token
    path: list[list[int]] | None = None  # draft trees (draft/tree.py): each request's accepted drafts; None: 0, 1, ...


def rejection_sample(p: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                     lengths: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor) -> Verdict:
    """p [T, V]; starts, lengths [R]; drafts [R, G]; q [R, G, V] or None for point-mass drafts;
    u_accept [R, G] and u_sample [R] uniforms in [0, 1)."""
    R, G = drafts.shape
    if G == 0:
        return Verdict(torch.zeros(R, dtype=torch.long), sample(p[starts], u_sample))
    offs = torch.arange(G)
    valid = offs[None, :] < lengths[:, None]
    rows = (starts[:, None] + offs[None, :]).clamp(max=p.shape[0] - 1)
    p_x = p[rows, drafts]  # [R, G]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    accept = (u_accept * q_x < p_x) & valid  # u < p/q, without dividing
    n = accept.long().cumprod(-1).sum(-1)  # accepted prefix length
    p_next = p[starts + n]  # [R, V]
    rejected = n < lengths
    r_idx = rejected.nonzero().squeeze(1)
    if len(r_idx):
        at = n[r_idx].clamp(max=G - 1)
        p_next = p_next.clone()
        p_next[r_idx] = residual(p_next[r_idx], None if q is None else q[r_idx, at], drafts[r_idx, at])
    return Verdict(n, sample(p_next, u_sample))


def greedy_verdict(best: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor) -> Verdict:
    """rejection_sample where every request is greedy, from each flat row's argmax best [T]: p is then a point mass
    on it, so a draft survives exactly when it is that argmax (u q(x) < 1 whatever q), and the next token is the
    argmax after the accepted drafts (the residual of a point mass on another token is that point mass)."""
    offs = torch.arange(drafts.shape[1])
    rows = (starts[:, None] + offs[None, :]).clamp(max=len(best) - 1)
    accept = (drafts == best[rows]) & (offs[None, :] < lengths[:, None])
    n = accept.long().cumprod(-1).sum(-1)
    return Verdict(n, best[starts + n])


def residual(p: torch.Tensor, q: torch.Tensor | None, rejected: torch.Tensor) -> torch.Tensor:
    """Unnormalised max(0, p - q) per row: p, q [n, V] at the rejected position, q None for a point mass
    on the rejected draft ([n])."""
    if q is None:
        out = p.clone()
        out[torch.arange(len(p)), rejected] = 0
    else:
        out = (p - q).clamp(min=0)
    # p == q up to rounding makes a rejection (almost) impossible; if it happens, p is the residual
    empty = out.sum(-1) <= 0
    out[empty] = p[empty]
    return out


def tree_verdict(best: torch.Tensor, starts: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 lengths: torch.Tensor) -> Verdict:
    """greedy_verdict over trees: best [T] each flat row's argmax; request r's rows start at starts[r], its first
    lengths[r] drafts tokens[r] hang on parents[r]. The walk follows the child holding the current row's argmax;
    path: each request's accepted drafts, root first."""
    best_rows, starts_l, lengths_l = best.tolist(), starts.tolist(), lengths.tolist()
    paths, nexts = [], []
    for r, (toks, pars) in enumerate(zip(tokens.tolist(), parents.tolist())):
        children: dict[int, dict[int, int]] = {}
        for k in range(lengths_l[r]):
            children.setdefault(pars[k], {}).setdefault(toks[k], k)
        node, path = -1, []
        while (child := children.get(node, {}).get(best_rows[starts_l[r] + node + 1])) is not None:
            path.append(child)
            node = child
        paths.append(path)
        nexts.append(best_rows[starts_l[r] + node + 1])
    return Verdict(torch.tensor([len(p) for p in paths]), torch.tensor(nexts), paths)
