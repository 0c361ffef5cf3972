"""Decode and verify forwards through every decoder layer in one call to fused_layers.cpp.

model.py's layer loop runs some twenty PyTorch operations a layer between its products, each a dispatch and a
pass over a few rows; on a small model they take over a quarter of a bf16 decode or verify forward
(benchmarks/results/forward_split.md: rest_share, on a 2-core Xeon with AMX). fused_layers.cpp runs the same
layers with skinny.cpp's products and vector loops between them: forward_split.md has it 1.92x as fast as the loop
for 1 token, 1.89x for 4 and 1.85x for 8 (fused_speedup).

It takes decode and verify forwards of at most MAX_TOKENS tokens of models whose weights are dense bf16 or float32
(not GGUF groups) with sizes that are multiples of 16, where skinny.cpp is built and Options.fused holds; model.py
splits wider forwards into such calls. Prefills come here where `fuses_prefill` says so (under Options.exact
wherever the layers fuse; otherwise bf16 targets on AMX's tiles, where it is faster than the loop:
benchmarks/results/prefill.md), request by request in chunks of at most MAX_TOKENS. Results equal model.py's loop
within rounding (the order of float32 sums differs; tested), and a token's results depend on its own row alone,
as with skinny.cpp's products; `attend_tokens` gives the loop the same attention where Options.exact holds.
A DSpark or DFlash drafter's backbone runs here too (draft/dspark.py): its layers have the same shape, with separate
q, k, v and gate, up weights, which are joined into copies once (`joined`), as fused_layers.cpp reads one qkv and
one gate_up weight a layer.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from . import upcast
from .. import options
from .skinny import flags, identity, kept, kernel, runs_tiles, tiles

FIELDS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up",
          "gate_up_bias", "down", "down_bias", "qkv_tiles", "o_tiles", "gate_up_tiles", "down_tiles")
FUNCTIONS = {torch.bfloat16: "fused_layers_bf16", torch.float32: "fused_layers_f32"}
ATTEND = {torch.bfloat16: "attend_tokens_bf16", torch.float32: "attend_tokens_f32"}
MAX_HEAD_DIM = 256  # fused_layers.cpp holds a head's query in registers
# forwards of more tokens take model.py's loop. fused_layers.cpp reads the weights once per 32 tokens, PyTorch's
# products once, so the fused forward's lead shrinks with the tokens; benchmarks/results/tiles.md (2-core AMX Xeon,
# SmolLM2-135M bf16, requests of 8 tokens after 200 cached; part forward) has it ahead up to 256 tokens, the widest
# measured, 1.71x there
MAX_TOKENS = 256


class LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in FIELDS]


class ModelWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "d", "heads", "kv_heads", "head_dim", "inter")] + [
        ("eps", ctypes.c_float), ("layer", ctypes.POINTER(LayerWeights))]


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layer_weights(layer) -> LayerWeights:
    attn = layer.self_attn
    qk_norm = getattr(attn, "qk_norm", True)  # a drafter's layers always have them
    q_norm = attn.q_norm.weight if qk_norm else None
    k_norm = attn.k_norm.weight if qk_norm else None
    qkv, o, gate_up, down = linears(layer)
    tensors = (layer.input_layernorm.weight, qkv.weight, qkv.bias, q_norm, k_norm, o.weight, o.bias,
               layer.post_attention_layernorm.weight, gate_up.weight, gate_up.bias, down.weight, down.bias,
               *map(tiles, (qkv, o, gate_up, down)))
    return LayerWeights(*map(pointer, tensors))


def linears(layer) -> tuple:
    """A decoder layer's (qkv, o, gate_up, down) products: the target's own, or for a drafter's layer (separate
    q, k, v and gate, up) copies joined once."""
    modules = parts(layer)
    if len(modules) == 4:
        return modules
    q, k, v, o, gate, up, down = modules
    return joined(q, k, v), o, joined(gate, up), down


def joined(*modules: nn.Linear) -> nn.Linear:
    """One nn.Linear stacking the outputs of `modules` (weights and biases concatenated), made once and kept on the
    first (again when their weights move or change)."""
    def join() -> nn.Linear:
        weight = torch.cat([m.weight.detach() for m in modules])
        joint = nn.Linear(weight.shape[1], weight.shape[0], bias=modules[0].bias is not None, device="meta")
        joint.weight = nn.Parameter(weight, requires_grad=False)
        if joint.bias is not None:
            joint.bias = nn.Parameter(torch.cat([m.bias.detach() for m in modules]), requires_grad=False)
        return joint
    return kept(modules[0], "_joined", tuple(identity(m.weight) for m in modules), join)


def parts(layer) -> tuple:
    """A decoder layer's own linear modules (the target's joined ones; a drafter's q, k, v, o, gate, up, down)."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def sizes_of(model) -> tuple[int, int]:
    """(hidden size, MLP size) of the model's layers."""
    return model.layers[0].input_layernorm.weight.numel(), parts(model.layers[0])[-1].weight.shape[1]


def fusable(model) -> bool:
    """Whether fused_layers.cpp can run the model's layers: dense contiguous weights (not GGUF groups, not a 4-bit
    target's) of a dtype it handles, sizes that are multiples of 16 (its vector width at most) and a head size it
    holds."""
    if not all(isinstance(getattr(m, "weight", None), torch.Tensor) and getattr(m, "groups", None) is None
               for layer in model.layers for m in parts(layer)):
        return False
    attn = model.layers[0].self_attn
    sizes = (*sizes_of(model), attn.head_dim)
    params = [p for layer in model.layers for p in layer.parameters()]
    return (model.dtype in FUNCTIONS and all(s % 16 == 0 for s in sizes) and attn.head_dim <= MAX_HEAD_DIM
            and all(p.dtype == model.dtype and p.is_contiguous() and p.is_cpu for p in params))


def model_weights(model) -> ModelWeights | None:
    """The layers' weight pointers for fused_layers.cpp (with their copies packed for AMX, skinny.tiles), built once
    per model (and again if its weights move or change); None where it cannot run them."""
    def table() -> ModelWeights | None:
        if not fusable(model):
            return None
        attn = model.layers[0].self_attn
        layers = (LayerWeights * len(model.layers))(*map(layer_weights, model.layers))
        d, inter = sizes_of(model)
        weights = ModelWeights(len(model.layers), d, attn.num_heads, attn.num_kv_heads, attn.head_dim, inter,
                               model.layers[0].input_layernorm.eps, layers)
        weights._layers = layers  # keeps the array alive
        return weights
    key = tuple(getattr(m, "weight", None) is not None and identity(m.weight)
                for m in (*parts(model.layers[0]), *parts(model.layers[-1]))) + (model.dtype, runs_tiles())
    return kept(model, "_fused_weights", key, table)


def fused_weights(model, batch) -> ModelWeights | None:
    """The model's weight table where this forward runs through fused_layers.cpp (not a prefill, at most MAX_TOKENS
    tokens, skinny.cpp built, the model fusable, Options.fused), else None."""
    if batch.prefill or len(batch.tokens) > MAX_TOKENS or not switched_on():
        return None
    return model_weights(model)


def switched_on() -> bool:
    """skinny.cpp built and Options.fused."""
    return options.current().fused and kernel() is not None


def fuses_prefill(model) -> bool:
    """Whether the model's prefills run here (model.py's `prefill_in_chunks`), each request alone in chunks of at
    most MAX_TOKENS: wherever the layers fuse under Options.exact (a prompt's rows then round as those tokens
    decoded alone); without it only for bf16 weights on AMX's tiles, where upcast.py's float32 path does not help."""
    if not switched_on() or model_weights(model) is None:
        return False
    return options.current().exact or (model.dtype == torch.bfloat16 and not upcast.UPCAST_HELPS and runs_tiles())


def takes_attend_tokens(q: torch.Tensor, cache) -> bool:
    """Whether the layer loop's attention runs token by token in fused_layers.cpp: Options.exact, the kernel built,
    a bf16 or float32 cache of q's dtype, and heads of at most MAX_HEAD_DIM."""
    return (options.current().exact and q.dtype in ATTEND and cache.k.dtype == q.dtype and q.shape[-1] <= MAX_HEAD_DIM
            and cache.k.is_contiguous() and kernel() is not None)


def attend_tokens(layer: int, q: torch.Tensor, batch, cache) -> torch.Tensor:
    """Attention of the batch's queries q [T, H, hd] over layer `layer` of `cache` (its keys and values written),
    token by token on fused_layers.cpp's vector loops, as fused forwards attend; returns [T, H * hd]."""
    T, H, hd = q.shape
    q = q.contiguous()
    out = torch.empty(T, H * hd, dtype=q.dtype)
    visible = batch.positions if batch.visible is None else batch.visible
    slots, visible = batch.slots.to(torch.long).contiguous(), visible.to(torch.long).contiguous()
    hidden = None if batch.hidden is None else batch.hidden.to(torch.long).contiguous()
    attend_entry(kernel(), q.dtype)(q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), layer, cache.k.shape[1], cache.k.shape[3],
             slots.data_ptr(), visible.data_ptr(), pointer(hidden), T, H, cache.k.shape[2], hd, out.data_ptr(),
             torch.get_num_threads())
    return out


def capture_slots(model) -> torch.Tensor:
    """[layers]: where each layer's outputs go among the captured features (-1: not captured), kept per
    capture_layers."""
    def slots() -> torch.Tensor:
        captured = sorted(set(key))
        where = torch.full((len(model.layers),), -1, dtype=torch.long)
        where[captured] = torch.arange(len(captured))
        return where
    key = tuple(getattr(model, "capture_layers", ()))  # a drafter captures none
    return kept(model, "_fused_capture", key, slots)


@functools.cache
def entry(lib: ctypes.CDLL, dtype: torch.dtype):
    """fused_layers.cpp's forward for `dtype` in the library, with its argument types."""
    function = getattr(lib, FUNCTIONS[dtype])
    function.argtypes = ([ctypes.POINTER(ModelWeights), ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2
                         + [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int])
    function.restype = None
    return function


@functools.cache
def attend_entry(lib: ctypes.CDLL, dtype: torch.dtype):
    """fused_layers.cpp's attend_tokens for `dtype` in the library, with its argument types (set once, not per
    layer)."""
    function = getattr(lib, ATTEND[dtype])
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [
        ctypes.c_void_p, ctypes.c_int]
    function.restype = None
    return function


def fused_forward(model, weights: ModelWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch,
                  cache) -> torch.Tensor | None:
    """Run every layer (`weights`: fused_weights' table) over x [T, d] (the embeddings, overwritten with the last
    layer's outputs), writing the batch's keys and values to `cache`; returns the captured layers' outputs
    [T, m * d] (None if none)."""
    n, d = x.shape
    if cache.k.dtype != x.dtype or not cache.k.is_contiguous():
        raise ValueError(f"fused layers need a contiguous {x.dtype} KV cache, not {cache.k.dtype}")
    capture = capture_slots(model)
    width = int((capture >= 0).sum()) * d
    features = torch.empty(n, width, dtype=x.dtype) if width else None
    visible = batch.positions if batch.visible is None else batch.visible
    slots, positions, visible = (t.to(torch.long).contiguous() for t in (batch.slots, batch.positions, visible))
    cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
    forward = entry(kernel(), x.dtype)
    hidden = None if batch.hidden is None else batch.hidden.to(torch.long).contiguous()
    forward(ctypes.byref(weights), n, slots.data_ptr(), positions.data_ptr(), visible.data_ptr(), pointer(hidden),
            cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[1], cache.k.shape[3], x.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), pointer(features), capture.data_ptr(), width, torch.get_num_threads(), flags())
    return features
