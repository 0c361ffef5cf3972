"""Sampling parameters and the distributions they define: temperature, top-k and top-p warp logits into
the probabilities that both the target (p) and the drafter (q) sample from; temperature 0 is greedy, a
point mass on the argmax."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .kernels.argmax import argmax_rows

MAX_LOGPROBS = 20  # alternatives per token at most
TOP_K_OFF = 2**62  # a top_k at least this large is no cut at all (and still fits a long)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    seed: int | None = None  # per-request generator; None draws a fresh seed
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: each token's target log-probability and its k best alternatives

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
             and self.temperature >= 0, f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"),
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             f"seed must be an integer or None, got {self.seed!r}"),  # any size: the generator takes it mod 2**64
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                       and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def param_tensors(params: list[SamplingParams], repeats: list[int] | None = None):
    """(temperature, top_p, top_k) as [N] tensors, one row per request repeated `repeats[r]` times."""
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    tp = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    tk = torch.tensor([min(p.top_k, TOP_K_OFF) for p in params], dtype=torch.long)  # any k >= V keeps every token
    if repeats is not None:
        r = torch.tensor(repeats)
        t, tp, tk = t.repeat_interleave(r), tp.repeat_interleave(r), tk.repeat_interleave(r)
    return t, tp, tk


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Probabilities [N, V] (float32) from logits [N, V] under per-row sampling settings.

    Order as in transformers: temperature, then top-k (ties at the k-th value kept), then top-p (the
    smallest prefix of the sorted distribution whose mass reaches top_p; the top token always kept).
    Each row's largest logit is subtracted before dividing by its temperature, so any temperature > 0, however
    small, gives finite probabilities (a tiny one: the point mass on the argmax, shared among exact ties).
    """
    logits = logits.float()
    greedy = temperature == 0
    if greedy.all():
        return point_mass(logits)
    scaled = (logits - logits.amax(-1, keepdim=True)) / torch.where(greedy, 1.0, temperature)[:, None]
    filt = ((top_k > 0) | (top_p < 1)) & ~greedy
    if filt.any():
        rows = filt.nonzero().squeeze(1)
        scaled[rows] = _filter(scaled[rows], top_p[rows], top_k[rows])
    probs = scaled.softmax(-1)
    if greedy.any():
        rows = greedy.nonzero().squeeze(1)
        probs[rows] = point_mass(logits[rows])
    return probs


def point_mass(logits: torch.Tensor) -> torch.Tensor:
    """Greedy: probability 1 on each row's argmax."""
    best = argmax_rows(logits.reshape(-1, logits.shape[-1])).view(*logits.shape[:-1], 1)
    return torch.zeros_like(logits).scatter_(-1, best, 1.0)


def _filter(sub: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, window: int = 256) -> torch.Tensor:
    """Top-k then top-p on rows of scaled logits [n, V]; dropped tokens become -inf.

    The cut almost always falls among the few hundred most likely tokens, so only those are sorted
    (torch.topk); a row whose cut the window does not decide takes the full sort."""
    V = sub.shape[-1]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    W = min(V, max(window, int(top_k.max()) + 1))
    cut = torch.empty(len(sub), 1)
    decided = torch.zeros(len(sub), dtype=torch.bool)
    if W < V:
        cut, decided = _cut(sub.topk(W, -1).values, k, top_p, sub.logsumexp(-1, keepdim=True))
    rest = (~decided).nonzero().squeeze(1)
    if len(rest):
        whole = sub[rest].sort(-1, descending=True).values
        cut[rest] = _cut(whole, k[rest], top_p[rest], whole.logsumexp(-1, keepdim=True))[0]  # whole row: exact
    return sub.masked_fill(sub < cut, float("-inf"))


def _cut(vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor):
    """From the W largest logits of each row (vals [n, W], descending; W = V is the whole row) and the row's
    logsumexp: the cut [n, 1] (logits below it are dropped) and whether the window decides it [n]."""
    W = vals.shape[-1]
    topk_on = k <= W  # within a window smaller than V: top-k is active and its k-th value is in view
    kth = torch.where(topk_on[:, None], vals.gather(-1, (k.clamp(max=W) - 1)[:, None]), float("-inf"))
    probs = torch.exp(vals - lse).masked_fill(vals < kth, 0.0)
    probs = torch.where(topk_on[:, None], probs / probs.sum(-1, keepdim=True), probs)  # top-k renormalises
    mass_before = probs.cumsum(-1) - probs
    keep = mass_before < top_p[:, None]
    keep[:, 0] = True
    threshold = torch.where(keep, vals, float("inf")).min(-1, keepdim=True).values
    # decided: top-k cuts inside the window (no tie with the k-th value beyond it), or top-p stops inside it
    decided = torch.where(topk_on, vals[:, -1] < kth[:, 0], ~keep[:, -1])
    return torch.maximum(threshold, kth), decided


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of probs [N, V] (need not be normalised) with uniforms u [N].

    Tokens of zero probability are never returned; a row without a finite positive mass (a fault upstream)
    gets -1, which the engine fails that request on.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * total, right=True)
    last_nonzero = torch.searchsorted(cdf, total.contiguous(), right=False)
    broken = ~(torch.isfinite(total) & (total > 0)).squeeze(1)
    return torch.minimum(idx, last_nonzero).squeeze(1).masked_fill(broken, -1)


def mend(choice: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Draft position k's sampled tokens with the rows `sample` found broken (-1) set to token 0, and those rows'
    draft lengths (in place) cut to k: a drafter whose distribution breaks drafts less; the target never sees it."""
    broken = choice < 0
    if bool(broken.any()):
        lengths[broken] = lengths[broken].clamp(max=k)
        choice = choice.clamp(min=0)
    return choice


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """For rows of target logits [n, V] and the token chosen at each: (token, its log-probability, the k most likely
    tokens with theirs), under the target's own distribution (temperature 1, no top-k/top-p cut)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
    top = lp.topk(k, -1) if k else None
    return [(t, c, [] if top is None else list(zip(top.indices[i].tolist(), top.values[i].tolist())))
            for i, (t, c) in enumerate(zip(tokens, chosen))]
