"""Per-step statistics: what benchmarks need for τ and SPS(B)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    num_requests: int = 0  # R, requests in the verify forward
    verify_tokens: int = 0  # B = Σ_r (1 + ℓ_r)
    drafted: list[int] = field(default_factory=list)  # drafts proposed per request
    verified: list[int] = field(default_factory=list)  # ℓ_r
    accepted: list[int] = field(default_factory=list)  # accepted drafts per request
    draft_skipped: bool = False  # the scheduler skipped the drafter call: a plain decoding step
    expected_tau: float | None = None  # Σ_r (1 + Σ_{j<=ℓ_r} a_rj): the confidences' prediction of self.tokens
    confidence: list[list[float]] | None = None  # c[R, γ], when the engine records it
    first: tuple[str, list[int], list[int]] | None = None  # the batch's first request: (id, drafts verified, new tokens)
    prefill_tokens: int = 0
    admitted: int = 0  # requests admitted (prefilled) this step
    t_prefill: float = 0.0  # seconds
    t_draft: float = 0.0
    t_plan: float = 0.0
    t_verify: float = 0.0  # target forward + LM head
    t_sample: float = 0.0  # warp + rejection sampling + commit
    t_total: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens this step committed by verification: Σ_r (accepted + 1)."""
        return sum(self.accepted) + self.num_requests

    @property
    def tau(self) -> float:
        """Mean acceptance length of the step (accepted drafts + 1 per request)."""
        return self.tokens / max(self.num_requests, 1)
