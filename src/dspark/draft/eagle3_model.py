"""The Eagle3-style autoregressive drafter, a baseline (and, with one feature layer and one step, MTP-1).

One decoder layer drafts one token per forward. Its input at position t is [RMSNorm(e(x_t)); RMSNorm(g_{t-1})]
(2d wide, into q/k/v), with g_{t-1} as the residual stream: g is the fused target feature fc([H^(low);
H^(mid); H^(high)]) at committed positions, and the drafter's own output hidden state (before the final
norm) at drafted ones, so step k+1 reads what step k produced. The target's embedding and LM head are
shared and frozen. The layer is Qwen3-style (per-head q/k norms), as our other drafters are.

MTP-1 (DeepSeek-V3's multi-token-prediction module, depth 1) is the same shape: the last target layer's
output as the only feature, one draft per cycle.

Parameter names follow Eagle3's released drafters: `fc`, `midlayer.*`, `norm`, `embed_tokens`, `lm_head`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers import RMSNorm
from .dspark_model import Attend, DraftAttention, DraftMLP, FeatureDrafterModel, build_target_layer_ids

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


class Eagle3Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = DraftAttention(c, 0, in_features=2 * c.hidden_size)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def layer_input(self, emb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], -1)

    def forward(self, emb, g, cos, sin, attend: Attend) -> torch.Tensor:
        h = g + self.self_attn(self.layer_input(emb, g), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(FeatureDrafterModel):
    confidence_head = None  # no confidence: its drafts are verified by length only

    def __init__(self, config: dict):
        super().__init__(config)  # block_size: draft steps per cycle
        self.midlayer = Eagle3Layer(self.c)
        self.norm = RMSNorm(self.c.hidden_size, self.c.rms_norm_eps)

    @property
    def layers(self):  # the layer list as DSparkModel names it (initialisation from the target reads it)
        return [self.midlayer]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g [N, d] from the concatenated target features [N, m*d]."""
        return self.fc(features.to(self.dtype))

    def context_kv(self, tokens: torch.Tensor, g_prev: torch.Tensor, positions: torch.Tensor):
        """[(keys, values)] of committed positions: token x_t with the fused feature g_{t-1}."""
        cos, sin = self.rotary(positions, g_prev.dtype)
        x = self.midlayer.layer_input(self.embed_tokens(tokens).to(self.dtype), g_prev)
        return [self.midlayer.self_attn.project_kv(x, cos, sin)]

    def step(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One draft step for N sequences: hidden state h [N, d] (fed back as the next g)."""
        cos, sin = self.rotary(positions, g.dtype)
        return self.midlayer(self.embed_tokens(tokens).to(self.dtype), g, cos, sin, attend)

    def draft_logits(self, h: torch.Tensor, dtype: torch.dtype | None = torch.float32, head=None) -> torch.Tensor:
        """Logits [N, V] of the token after the one stepped (over `head`'s rows if given), in `dtype` (None: the
        LM head's own)."""
        z = (self.lm_head if head is None else head)(self.norm(h).to(self.embed_tokens.weight.dtype))
        return z if dtype is None else z.to(dtype)


def eagle3_config(target_config: dict, *, block_size: int = 7, num_features: int = 3, mtp: bool = False,
                  num_anchors: int = 64) -> dict:
    """A config.json for an Eagle3-style drafter (mtp: MTP-1, the last target layer, one step)."""

    cfg = {k: v for k, v in target_config.items() if k not in ("quantization_config", "_name_or_path")}
    n_target = target_config["num_hidden_layers"]
    cfg.update(architectures=[EAGLE3_ARCHITECTURE], num_hidden_layers=1, num_target_layers=n_target,
               target_layer_ids=[n_target - 1] if mtp else build_target_layer_ids(n_target, num_features),
               block_size=1 if mtp else block_size, num_anchors=num_anchors, drafter_type="mtp" if mtp else "eagle3",
               tie_word_embeddings=False)
    cfg.setdefault("head_dim", target_config["hidden_size"] // target_config["num_attention_heads"])
    return cfg
