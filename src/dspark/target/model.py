"""The target model's forward over a flat batch of tokens from many requests (Llama and Qwen3 families).

Linear layers run on the flat batch [T, d] (no padding). Attention reads each request's keys and values
from the KV cache; request r's queries see keys at positions <= their own position, which covers both
the committed prefix and the earlier tokens of the same forward (they are written to the cache first).
Decode and verify forwards of dense models run the layers in one call to fused_layers.cpp instead of this loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import options
from ..kernels.fused_layers import (MAX_TOKENS, attend_tokens, fused_forward, fused_weights, fuses_prefill,
                                    model_weights, switched_on, takes_attend_tokens)
from ..kernels.onednn import linear
from ..kernels.upcast import product_kernel
from ..layers import Linear, RMSNorm, Rotary, apply_rotary
from .kv_cache import KVCache


@dataclass
class FlatBatch:
    """One forward's input: request r contributes tokens[starts[r]:starts[r+1]] at its own positions.

    The requests occupy the contiguous cache slots slot_start .. slot_start + R - 1, in order. A query
    reads the keys at positions <= visible (default: its own position, i.e. causal attention; a drafter
    block sets it to the block's last position, so attention inside the block is bidirectional), but those
    `hidden` hides: bit j (1..62) of hidden[t] hides the key at visible[t] - j. A draft tree verifies its nodes
    (in an order where parents come first) at positions num_cached + 1, 2, ...: each node hides the nodes before it
    that are not its ancestors, and its rotary position (`rotary_positions`) is num_cached + its depth.
    """

    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    query_lens: list[int]  # [R]
    slot_start: int = 0
    visible: torch.Tensor | None = None  # [T] long
    prefill: bool = False  # see `prefill_attention` and upcast.py
    hidden: torch.Tensor | None = None  # [T] int64 bit masks (see above); None: none hidden
    rotary_positions: torch.Tensor | None = None  # [T] long; None: the positions

    def __post_init__(self):
        lens = torch.tensor(self.query_lens, dtype=torch.long)
        self.num_requests = len(self.query_lens)
        self.request_of_token = torch.repeat_interleave(torch.arange(self.num_requests), lens)  # [T]
        self.starts = torch.cumsum(lens, 0) - lens  # [R]
        self.max_query_len = max(self.query_lens)
        # padded [R, Qmax] view of the flat queries; padding rows point at token 0 and are never read back
        offs = torch.arange(self.max_query_len)
        self.query_valid = offs[None, :] < lens[:, None]
        self.padded_index = torch.where(self.query_valid, self.starts[:, None] + offs[None, :], 0)
        self.flat_index = self.query_valid.flatten().nonzero().squeeze(1)  # padded row -> flat order
        self.slots = self.slot_start + self.request_of_token
        visible = self.positions if self.visible is None else self.visible
        self.key_len = int(visible.max()) + 1
        padded_vis = torch.where(self.query_valid, visible[self.padded_index], 0)
        # mask[r, 0, i, j]: query i of request r may read key position j
        self.attn_mask = torch.arange(self.key_len)[None, None, None, :] <= padded_vis[:, None, :, None]
        if self.hidden is not None:
            if bool((self.hidden < 0).any()) or bool((self.hidden & 1).any()):
                raise ValueError("hidden: bits 1..62 only (a token never hides itself)")
            back = padded_vis[:, :, None] - torch.arange(self.key_len)[None, None, :]  # [R, Q, L]: visible - key
            bits = torch.where(self.query_valid, self.hidden[self.padded_index], 0)
            hides = (back >= 1) & (back <= 62) & ((bits[:, :, None] >> back.clamp(0, 62)) & 1).bool()
            self.attn_mask &= ~hides[:, None]
        self.sparse_mask = None if bool(self.attn_mask.all()) else self.attn_mask

    def requests(self, first: int, end: int) -> "FlatBatch":
        """The batch of requests first .. end - 1 alone (their rows, masks and cache slots)."""
        a, b = int(self.starts[first]), int(self.starts[end - 1]) + self.query_lens[end - 1]
        return self.rows(a, b, self.query_lens[first:end], first)

    def rows(self, a: int, b: int, query_lens: list[int], first: int) -> "FlatBatch":
        """Rows a .. b - 1, which are the tokens of whole requests from request `first` on (query_lens), or a run of
        one request's tokens (its later tokens then read the earlier ones from the cache)."""
        part = (lambda t: None if t is None else t[a:b])
        return FlatBatch(self.tokens[a:b], self.positions[a:b], query_lens, self.slot_start + first, part(self.visible),
                         self.prefill, part(self.hidden), part(self.rotary_positions))

    @property
    def last_index(self) -> torch.Tensor:
        """Flat index of each request's last token."""
        return self.starts + torch.tensor(self.query_lens) - 1


def grouped_attention(q, keys, values, mask):
    """Softmax attention of [R, H, Q, hd] queries over [R, KVH, L, hd] keys (H a multiple of KVH).

    The H // KVH query heads sharing a KV head are one matmul; mask [R, 1, Q, L] or None (all visible).
    """
    R, H, Q, hd = q.shape
    kvh = keys.shape[1]
    qg = q.reshape(R, kvh, (H // kvh) * Q, hd)
    scores = (qg @ keys.transpose(-1, -2)).float() * hd**-0.5  # [R, KVH, G*Q, L]
    if mask is not None:
        scores = scores.view(R, kvh, H // kvh, Q, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype).view(R, kvh, (H // kvh) * Q, -1)
    return (probs @ values).view(R, H, Q, hd)


def prefill_attention(q, keys, values, batch: FlatBatch) -> torch.Tensor:
    """Each request's queries [n, H, hd] over its own keys, one call per request, returned as [T, H * hd].

    The shapes of a call depend on its request alone, so a prompt's prefill does not depend on what else is
    admitted with it (batch invariance; the padded batched call below rounds differently with the padding).
    """
    visible = batch.positions if batch.visible is None else batch.visible
    outs = []
    for r, (start, n) in enumerate(zip(batch.starts.tolist(), batch.query_lens)):
        L = int(visible[start:start + n].max()) + 1
        out = F.scaled_dot_product_attention(q[None, start:start + n].transpose(1, 2), keys[r:r + 1, :, :L],
                                             values[r:r + 1, :, :L], attn_mask=batch.attn_mask[r:r + 1, :, :n, :L],
                                             enable_gqa=True)
        outs.append(out[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(outs)


def token_attention(q, keys, values, batch: FlatBatch) -> torch.Tensor:
    """Each token's queries [H, hd] alone over the keys [KVH, L, hd] it may read, gathered in order (as the same token
    decoded alone finds them), in float32 with PyTorch's kernels and no mask: the same call for a token whatever
    else is in the forward (Options.exact without the compiled kernels). Returns [T, H * hd]."""
    outs = []
    for t in range(len(batch.tokens)):
        r = int(batch.request_of_token[t])
        seen = batch.attn_mask[r, 0, t - int(batch.starts[r])].nonzero().squeeze(1)
        out = F.scaled_dot_product_attention(q[t, :, None].float()[None], keys[r:r + 1, :, seen].float(),
                                             values[r:r + 1, :, seen].float(), enable_gqa=True)
        outs.append(out.reshape(1, -1))
    return torch.cat(outs).to(q.dtype)


def cached_attention(layer: int, q, k, v, batch: FlatBatch, cache: KVCache, exact: bool | None = None) -> torch.Tensor:
    """Write the batch's keys/values ([T, KVH, hd]) to the cache, attend with queries [T, H, hd] over each
    request's cached keys under the batch's mask, and return [T, H * hd]. exact (default: Options.exact): token by
    token, as the numerics contract needs; drafters pass False (their q is returned exactly as it was sampled from,
    so they need no contract)."""
    T, H, _ = q.shape
    keys, values = cache.write(layer, batch, k, v)  # [R, KVH, key_len, hd] views
    if options.current().exact if exact is None else exact:  # token by token: a token's own keys alone
        if takes_attend_tokens(q, cache):
            return attend_tokens(layer, q, batch, cache)
        return token_attention(q, keys, values, batch)
    if batch.prefill:
        return prefill_attention(q, keys, values, batch)
    R, Q = batch.num_requests, batch.max_query_len
    qp = (q.view(R, 1, H, -1) if Q == 1 else q[batch.padded_index]).transpose(1, 2)  # [R, H, Q, hd]
    if Q > 16:  # long prefill: the fused kernel wins
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=batch.attn_mask, enable_gqa=True)
    elif R == 1:  # one request: the fused kernel, in float32 (the faster way for one request)
        out = F.scaled_dot_product_attention(qp.float(), keys.float(), values.float(), attn_mask=batch.sparse_mask,
                                             enable_gqa=True).to(q.dtype)
    else:  # decode and verify of many requests: one batched matmul over requests
        out = grouped_attention(qp, keys, values, batch.sparse_mask)
    out = out.transpose(1, 2).reshape(R * Q, -1)
    return out if R * Q == T else out[batch.flat_index]


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # Qwen2 always has q/k/v biases; Llama's attention_bias also puts one on o_proj
        bias = getattr(config, "attention_bias", None) or config.model_type == "qwen2"
        d = config.hidden_size
        self.qkv_proj = Linear(d, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, d, bias=bias and config.model_type == "llama")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch: FlatBatch, cache: KVCache, product) -> torch.Tensor:
        T, H, KVH = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x, product).view(T, H + 2 * KVH, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H:H + KVH])), 1)
        else:
            qk = qkv[:, :H + KVH]
        qk = apply_rotary(qk, cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH:]
        return self.o_proj(cached_attention(self.layer_idx, q, k, v, batch, cache), product)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, h = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(d, 2 * h, bias=bias)  # gate, up stacked
        self.down_proj = Linear(h, d, bias=bias)

    def forward(self, x, product=linear):
        gate, up = self.gate_up_proj(x, product).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, product)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch, cache, product=linear):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, product)
        return x + self.mlp(self.post_attention_layernorm(x), product)


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [T, d] final-normed hidden states
    features: torch.Tensor | None  # [T, m*d] outputs of the captured layers, concatenated


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' parameter names (without `model.`) -> ours: q/k/v and gate/up stacked."""
    out = dict(state)
    for name in state:
        for fused, parts in FUSED.items():
            module, _, kind = name.rpartition(".")
            if module.endswith(parts[0]):
                prefix = module[: -len(parts[0])]
                out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(f"{prefix}{p}.{kind}") for p in parts])
    return out


class TargetModel(nn.Module):
    """A Llama/Qwen3 decoder; load weights with `fuse_projections` applied to transformers' names."""

    def __init__(self, config):
        super().__init__()
        if config.model_type not in ("llama", "qwen3", "qwen2", "mistral"):
            raise ValueError(f"unsupported model family {config.model_type!r}: dspark runs Llama and Qwen3 targets")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)
        self.capture_layers: tuple[int, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, cache: KVCache) -> TargetOutput:
        if batch.prefill and fuses_prefill(self):
            return self.prefill_in_chunks(batch, cache)
        if not batch.prefill and len(batch.tokens) > MAX_TOKENS and self.fuses_wide():
            return self.in_pieces(batch, cache)
        x = self.embed_tokens(batch.tokens)
        cos, sin = self.rotary(batch.positions if batch.rotary_positions is None else batch.rotary_positions, x.dtype)
        if (weights := fused_weights(self, batch)) is not None:  # decode and verify: the layers in one call
            features = fused_forward(self, weights, x, cos, sin, batch, cache)
            return TargetOutput(self.norm(x), features)
        product = product_kernel(x, self.lm_head.weight, batch.prefill, exact=options.current().exact)
        captured = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, cache, product)
            if i in self.capture_layers:
                captured.append(x)
        features = torch.cat(captured, dim=-1) if captured else None
        return TargetOutput(self.norm(x), features)

    def prefill_in_chunks(self, batch: FlatBatch, cache: KVCache) -> TargetOutput:
        """A prefill through fused_layers.cpp (`fuses_prefill`): each request alone, in chunks of at most MAX_TOKENS
        that read the earlier chunks from the cache, so a prompt's rows depend on the prompt alone."""
        outs = []
        for r, n in enumerate(batch.query_lens):
            first = int(batch.starts[r])
            for a in range(first, first + n, MAX_TOKENS):
                b = min(first + n, a + MAX_TOKENS)
                chunk = FlatBatch(batch.tokens[a:b], batch.positions[a:b], [b - a], batch.slot_start + r)
                outs.append(self(chunk, cache))
        return joined(outs)

    def fuses_wide(self) -> bool:
        """Whether forwards of more than MAX_TOKENS tokens run through fused_layers.cpp in pieces (Options.exact), not
        in the layer loop, whose products round otherwise."""
        return options.current().exact and switched_on() and model_weights(self) is not None

    def in_pieces(self, batch: FlatBatch, cache: KVCache) -> TargetOutput:
        """A forward of more than MAX_TOKENS tokens as forwards of whole requests, at most MAX_TOKENS tokens each
        where the requests allow (`fuses_wide`); the requests' rows are the same either way."""
        outs, first, tokens = [], 0, 0
        for r, n in enumerate(batch.query_lens):
            if r > first and tokens + n > MAX_TOKENS:
                outs.append(self(batch.requests(first, r), cache))
                first, tokens = r, 0
            tokens += n
        if tokens <= MAX_TOKENS:
            outs.append(self(batch.requests(first, batch.num_requests), cache))
        else:  # one request wider than MAX_TOKENS: runs of its tokens, in order
            start = int(batch.starts[first])
            for a in range(start, start + tokens, MAX_TOKENS):
                b = min(start + tokens, a + MAX_TOKENS)
                outs.append(self(batch.rows(a, b, [b - a], first), cache))
        return joined(outs)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """LM head in the model dtype (through `product_kernel`'s choice), returned [N, V] in `dtype` (None:
        the model's own)."""
        z = self.lm_head(hidden, product_kernel(hidden, self.lm_head.weight, exact=options.current().exact))
        return z if dtype is None else z.to(dtype)


def joined(outs: list[TargetOutput]) -> TargetOutput:
    """The outputs of consecutive pieces of one forward, as the forward's."""
    features = None if outs[0].features is None else torch.cat([o.features for o in outs])
    return TargetOutput(torch.cat([o.hidden for o in outs]), features)
