"""The DSpark drafter (docs/method.md): a parallel backbone that drafts a block in one forward, a cheap
sequential head (Markov, gated Markov or RNN) and a confidence head. With markov_rank 0 it is DFlash.

Parameter names follow the released layout (docs/checkpoint_format.md). The backbone's layers are Qwen3-style
(per-head q/k norms) whatever the target family; context features enter every layer as extra keys and
values: K = [W_K H_ctx; W_K H_d], V = [W_V H_ctx; W_V H_d], with H_ctx = RMSNorm(fc([H^(l_1); ...])).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import RMSNorm, Rotary, apply_rotary
from ..kernels.upcast import ManyRowsLinear as Linear

# attend(layer, q [T, H, hd], k [T, KVH, hd], v [T, KVH, hd]) -> [T, H * hd]: the block's attention over
# context and block keys; inference reads the context from a KV cache, training from dense tensors.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def config_namespace(config: dict) -> SimpleNamespace:
    ns = SimpleNamespace(**config)
    ns.head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ns



def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spaced target layers from the second to the third-from-last (DFlash's choice)."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_features - 1)) for i in range(num_features)]

class DraftAttention(nn.Module):
    def __init__(self, c, layer_idx: int, in_features: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = getattr(c, "attention_bias", False)
        d_in = in_features or c.hidden_size  # Eagle3's layer reads [embedding; hidden], 2d wide
        self.q_proj = Linear(d_in, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(d_in, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(d_in, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def project_kv(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [N, KVH, hd] of hidden states h [N, d]."""
        k = self.k_norm(self.k_proj(h).view(h.shape[0], self.num_kv_heads, self.head_dim))
        return apply_rotary(k, cos, sin), self.v_proj(h).view(h.shape[0], self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos, sin, attend: Attend) -> torch.Tensor:
        q = apply_rotary(self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        return self.o_proj(attend(self.layer_idx, q, k, v))


class DraftMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(c, layer_idx)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, attend: Attend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """B(x_{k-1}, ·): vanilla W2 W1[x_{k-1}]; gated W2(σ(gate([h_k; W1[x]])) ⊙ W1[x]); or an RNN whose
    state s_k carries the block's history (docs/method.md)."""

    def __init__(self, c):
        super().__init__()
        r, d = c.markov_rank, c.hidden_size
        self.kind = c.markov_head_type
        if self.kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type must be vanilla, gated or rnn, got {self.kind!r}")
        self.rank = r
        self.markov_w1 = nn.Embedding(c.vocab_size, r)
        self.markov_w2 = Linear(r, c.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = Linear(2 * r + d, 3 * r)

    def initial_state(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(n, self.rank) if self.kind == "rnn" else None

    def rank_input(self, prev: torch.Tensor, h: torch.Tensor, state):
        """prev [N] tokens x_{k-1}, h [N, d] -> (u [N, r] with bias W2 u, W1[x_{k-1}] [N, r], next state)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return e, e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e, e, None
        g, cand, out = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)
        g = torch.sigmoid(g)
        state = g * state + (1 - g) * torch.tanh(cand)
        return torch.tanh(out), e, state

    def forward(self, prev: torch.Tensor, h: torch.Tensor, state):
        """prev [N] tokens x_{k-1}, h [N, d] -> (bias [N, V], W1[x_{k-1}] [N, r], next state)."""
        u, e, state = self.rank_input(prev, h, state)
        return self.markov_w2(u), e, state


class ConfidenceHead(nn.Module):
    """c_k = σ(w^T [h_k; W1[x_{k-1}]]): survival of x_k given x_1..x_{k-1} survived; never reads x_k."""

    def __init__(self, c, with_markov: bool):
        super().__init__()
        self.proj = Linear(c.hidden_size + (c.markov_rank if with_markov else 0), 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """Confidence logit [N]."""
        return self.proj(h if e is None else torch.cat([h, e], -1)).squeeze(-1)


class FeatureDrafterModel(nn.Module):
    """What every drafter that reads target features has: its config, the target's embedding and LM head
    (frozen, shared), the context projection fc over the chosen target layers, and rotary tables."""

    draft_ids: torch.Tensor | None = None  # the draft vocabulary (draft_vocab.py) the heads were cut to, if any

    def __init__(self, config: dict):
        super().__init__()
        c = self.c = config_namespace(config)
        self.config = dict(config)
        self.block_size = c.block_size
        self.target_layer_ids = tuple(c.target_layer_ids)
        d = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.lm_head = Linear(d, c.vocab_size, bias=False)
        self.fc = Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.rotary_config = SimpleNamespace(**{**config, "head_dim": c.head_dim})
        self.rotary = Rotary(self.rotary_config)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype


class DSparkModel(FeatureDrafterModel):
    def __init__(self, config: dict):
        super().__init__(config)
        c, d = self.c, self.c.hidden_size
        self.mask_token_id = c.mask_token_id
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.markov_head = MarkovHead(c) if c.markov_rank > 0 else None
        self.confidence_head = (ConfidenceHead(c, c.confidence_head_with_markov and c.markov_rank > 0)
                                if c.enable_confidence_head else None)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx [N, d] from the concatenated target features [N, m*d]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor):
        """Per layer (keys, values) of the projected context at its positions."""
        cos, sin = self.rotary(positions, h_ctx.dtype)
        return [layer.self_attn.project_kv(h_ctx, cos, sin) for layer in self.layers]

    def backbone(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Final-normed hidden states h [T, d] of block tokens (anchor and mask ids) at their positions."""
        x = self.embed_tokens(tokens).to(self.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return self.norm(x)

    def base_logits(self, h: torch.Tensor, dtype: torch.dtype | None = torch.float32, head=None) -> torch.Tensor:
        """U [.., V] of the frozen, shared LM head (or `head`, its rows of a draft vocabulary), in `dtype` (None:
        the head's own)."""
        U = (self.lm_head if head is None else head)(h.to(self.embed_tokens.weight.dtype))
        return U if dtype is None else U.to(dtype)

    def head_step(self, prev: torch.Tensor, h: torch.Tensor, state):
        """One sequential step: (Markov bias [N, V] or None, confidence logit [N] or None, next state)."""
        u, conf, state = self.head_inputs(prev, h, state)
        return (None if u is None else self.markov_head.markov_w2(u).float()), conf, state

    def head_inputs(self, prev: torch.Tensor, h: torch.Tensor, state):
        """head_step before W2: (the Markov head's u [N, r] or None, confidence logit [N] or None, next state)."""
        u, e = None, None
        if self.markov_head is not None:
            u, e, state = self.markov_head.rank_input(prev, h, state)
        conf = self.confidence_head(h, e) if self.confidence_head is not None else None
        return u, conf, state

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """[N, γ] block tokens: the anchor then γ-1 mask ids."""
        block = torch.full((anchors.shape[0], self.block_size), self.mask_token_id, dtype=torch.long)
        block[:, 0] = anchors
        return block
