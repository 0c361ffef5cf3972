"""Sampling parameters and the distributions they define: temperature, top-k and top-p warp logits into
the probabilities that both the target (p) and the drafter (q) sample from; temperature 0 is greedy, a
point mass on the argmax."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    seed: int | None = None  # per-request generator; None draws a fresh seed
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

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
             f"seed must be an integer or None, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
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
    tk = torch.tensor([p.top_k for p in params], dtype=torch.long)
    if repeats is not None:
        r = torch.tensor(repeats)
        t, tp, tk = t.repeat_interleave(r), tp.repeat_interleave(r), tk.repeat_interleave(r)
    return t, tp, tk


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Probabilities [N, V] (float32) from logits [N, V] under per-row sampling settings.

    Order as in transformers: temperature, then top-k (ties at the k-th value kept), then top-p (the
    smallest prefix of the sorted distribution whose mass reaches top_p; the top token always kept).
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    filt = ((top_k > 0) | (top_p < 1)) & ~greedy
    if filt.any():
        rows = filt.nonzero().squeeze(1)
        sub = scaled[rows]
        sorted_logits, _ = sub.sort(-1, descending=True)
        k = torch.where(top_k[rows] > 0, top_k[rows], sub.shape[-1]).clamp(max=sub.shape[-1])
        kth = sorted_logits.gather(-1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep = mass_before < top_p[rows][:, None]
        keep[:, 0] = True
        # smallest kept logit is the threshold; ties with it are kept
        threshold = torch.where(keep, sorted_logits, float("inf")).min(-1, keepdim=True).values
        scaled[rows] = sub.masked_fill(sub < torch.maximum(threshold, kth), float("-inf"))
    probs = scaled.softmax(-1)
    if greedy.any():
        rows = greedy.nonzero().squeeze(1)
        probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(-1), logits.shape[-1]).float()
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of probs [N, V] (need not be normalised) with uniforms u [N].

    Tokens of zero probability are never returned.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * total, right=True)
    last_nonzero = torch.searchsorted(cdf, total.contiguous(), right=False)
    return torch.minimum(idx, last_nonzero).squeeze(1)
