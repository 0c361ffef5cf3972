"""DSpark's sequential heads as inference runs them: the same functions as DSparkModel.head_step, arranged for few
rows. W2 is kept transposed in float32 ([r, V]), so a step's Markov bias is one small product of u [R, r] (a rank-r
update of the logits, read in order) instead of a skinny product over V rows of r; the confidence head is split
into its h part, one product for the whole block before the steps, and its W1[x_{k-1}] part, a dot product per step.
Sums run in another order than head_step's (and stay in float32), so the values agree to rounding."""
from __future__ import annotations

import torch

from ..kernels.skinny import identity, kept
from .dspark_model import DSparkModel


class InferenceHeads:
    def __init__(self, model: DSparkModel):
        markov, confidence = model.markov_head, model.confidence_head
        self.markov = markov
        self.w2t = None if markov is None else markov.markov_w2.weight.detach().float().t().contiguous()
        self.conf_h = self.conf_e = None
        self.conf_bias = 0.0
        if confidence is not None:
            w, d = confidence.proj.weight.detach().float()[0], model.c.hidden_size
            self.conf_h = w[:d].contiguous()
            self.conf_e = w[d:].contiguous() if w.numel() > d else None
            if confidence.proj.bias is not None:
                self.conf_bias = float(confidence.proj.bias.detach().float()[0])

    @staticmethod
    def of(model: DSparkModel) -> "InferenceHeads":
        """The model's, made on first use and again when its head weights change."""
        weights = [model.markov_head.markov_w2.weight] if model.markov_head is not None else []
        weights += [model.confidence_head.proj.weight] if model.confidence_head is not None else []
        return kept(model, "_inference_heads", tuple(identity(w) for w in weights), lambda: InferenceHeads(model))

    def block_confidence(self, h: torch.Tensor) -> torch.Tensor | None:
        """The h part of every position's confidence logit, bias included: h [R, K, d] -> [R, K]."""
        return None if self.conf_h is None else h.float() @ self.conf_h + self.conf_bias

    def step(self, prev: torch.Tensor, h: torch.Tensor, state, conf_part: torch.Tensor | None):
        """One sequential step: (Markov bias [R, V] float32 or None, confidence logit [R] or None, next state), as
        head_step; conf_part: this position's column of block_confidence."""
        if self.markov is None:
            return None, conf_part, state
        u, e, state = self.markov.rank_input(prev, h, state)
        conf = conf_part if conf_part is None or self.conf_e is None else conf_part + e.float() @ self.conf_e
        return u.float() @ self.w2t, conf, state
