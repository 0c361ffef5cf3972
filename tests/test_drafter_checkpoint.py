"""Drafter checkpoints follow the released layout (docs/checkpoint_format.md): the parameter table and config of every
head kind, a bit-exact save/load round trip (float32 and bf16), a folder written by another tool loads, and a
checkpoint for another target, or without its frozen weights and no target, is refused with a clear message."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter import sequence, train_block
from tiny_models import BLOCK, HEAD_KINDS, HIDDEN, RANK, VOCAB, meta_target, one_thread, tiny_drafter, tiny_target, \
    tiny_target_dir

from dspark.draft.checkpoint import load_drafter, save_drafter

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]  # fixtures used here
pytestmark = pytest.mark.usefixtures("one_thread")


def expected_shapes(kind: str, num_features: int = 3, layers: int = 1) -> dict[str, tuple[int, ...]]:
    """docs/checkpoint_format.md's parameter table for the tiny drafter (Qwen3 layer shapes, 4 heads of 16)."""
    d, r, V, kv = HIDDEN, RANK, VOCAB, 2 * 16
    shapes = {"embed_tokens.weight": (V, d), "lm_head.weight": (V, d), "fc.weight": (d, num_features * d),
              "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                       p + "mlp.gate_proj.weight": (128, d), p + "mlp.up_proj.weight": (128, d),
                       p + "mlp.down_proj.weight": (d, 128)})
    if kind == "dflash":
        shapes.update({"confidence_head.proj.weight": (1, d), "confidence_head.proj.bias": (1,)})
        return shapes
    shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
                   "confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)})
    if kind == "gated":
        shapes.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
    if kind == "rnn":
        shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)})
    return shapes


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_checkpoint_has_the_released_layout(tiny_target, kind, tmp_path):
    save_drafter(tiny_drafter(tiny_target, kind), tmp_path, export_frozen=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rank = 0 if kind == "dflash" else RANK
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["num_hidden_layers"], config["num_target_layers"], config["target_layer_ids"]) == (1, 6, [1, 2, 3])
    assert (config["block_size"], config["num_anchors"], config["markov_rank"]) == (BLOCK, 8, rank)
    assert config["markov_head_type"] == ("vanilla" if kind == "dflash" else kind)
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is (rank > 0)
    assert config["tie_word_embeddings"] is False and config["layer_types"] == ["full_attention"]
    assert 0 <= config["mask_token_id"] < VOCAB and config["vocab_size"] == VOCAB
    assert config["hidden_size"] == HIDDEN and config["rope_parameters"]["rope_theta"] == 50000.0
    state = load_file(tmp_path / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(kind)
    save_drafter(tiny_drafter(tiny_target, kind), tmp_path / "trainable")  # default: frozen weights left out
    assert set(load_file(tmp_path / "trainable" / "model.safetensors")) == set(expected_shapes(kind)) - {
        "embed_tokens.weight", "lm_head.weight"}


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_save_load_round_trip_is_bit_exact(tiny_target, kind, tmp_path):
    model = tiny_drafter(tiny_target, kind, seed=11)
    save_drafter(model, tmp_path)
    loaded = load_drafter(tmp_path, tiny_target)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert set(mine) == set(theirs)
    for name, tensor in mine.items():
        assert theirs[name].dtype == tensor.dtype and torch.equal(theirs[name], tensor), name
    assert loaded.embed_tokens.weight is tiny_target.embed_tokens.weight  # shared, not copied
    assert not any(p.requires_grad for p in (loaded.embed_tokens.weight, loaded.lm_head.weight))
    assert torch.equal(loaded.rotary.inv_freq, model.rotary.inv_freq)
    seq = sequence(16, 9)
    (q, c), (q2, c2) = train_block(model, tiny_target, seq, 5), train_block(loaded, tiny_target, seq, 5)
    assert torch.equal(q, q2) and torch.equal(c, c2)
    half = load_drafter(save_drafter(model, tmp_path / "bf16", dtype=torch.bfloat16), tiny_target, dtype=torch.bfloat16)
    for name, tensor in half.state_dict().items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, mine[name].bfloat16()), name


def test_loads_a_checkpoint_written_by_another_tool(tiny_target, tmp_path):
    """A DeepSpec-style folder: a transformers-4 style config (rope_theta at top level, unknown fields)
    and a bf16 model.safetensors holding every weight, frozen ones included."""
    model = tiny_drafter(tiny_target, "rnn", seed=12)
    config = {k: v for k, v in model.config.items() if k not in ("rope_parameters", "dtype", "torch_dtype")}
    config.update(rope_theta=50000.0, rope_scaling=None, torch_dtype="bfloat16", transformers_version="4.57.1",
                  use_cache=True, deepspec_training={"lr": 6e-4, "epochs": 3}, some_future_field=[1, 2])
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().bfloat16().contiguous() for k, v in reversed(model.state_dict().items())}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    standalone = load_drafter(tmp_path)  # no target: the file's own frozen weights
    for name, tensor in state.items():
        assert torch.equal(standalone.state_dict()[name], tensor), name
    assert standalone.dtype == torch.bfloat16 and standalone.c.markov_head_type == "rnn"
    assert torch.equal(standalone.rotary.inv_freq, model.rotary.inv_freq)
    with_target = load_drafter(tmp_path, tiny_target, dtype=torch.float32)
    assert with_target.lm_head.weight is tiny_target.lm_head.weight
    assert torch.equal(with_target.markov_head.joint_proj.weight, state["markov_head.joint_proj.weight"].float())


@pytest.mark.parametrize("field,other", [("vocab_size", 600), ("hidden_size", 32), ("num_hidden_layers", 3)])
def test_checkpoint_for_another_target_is_refused(tiny_target, tmp_path, field, other):
    save_drafter(tiny_drafter(tiny_target, "vanilla"), tmp_path)
    with pytest.raises(ValueError, match="different target|target layers") as info:
        load_drafter(tmp_path, meta_target(**{field: other}))
    assert str(other) in str(info.value)


def test_checkpoint_without_frozen_weights_needs_the_target(tiny_target, tmp_path):
    save_drafter(tiny_drafter(tiny_target, "vanilla"), tmp_path)
    with pytest.raises(ValueError, match="pass the target"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    with pytest.raises(ValueError, match="not a DSpark/DFlash/Eagle3 drafter config"):
        load_drafter(tmp_path)
