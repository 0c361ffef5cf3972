"""Our drafters and SpecForge's (`specforge` 0.2.0 from the package registry, its own `DSparkDraftModel`): a drafter
exported here in the specforge layout loads strictly in SpecForge's class, and one saved by SpecForge loads here; on
real target features of the bundled SmolLM2 both compute the same logits, draft distributions (the Markov head
teacher-forced) and confidences, for the vanilla, gated and RNN heads. The default (deepspec) export holds every weight
a complete-layout loader reads. The agreement figures are in the run's summary ("reported figures")."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from specforge.modeling.draft.dspark import DSparkDraftModel
from transformers import Qwen3Config

from dspark.draft import DEFAULT_DRAFTER_DIR
from dspark.draft.checkpoint import FROZEN, load_drafter, save_drafter
from dspark.draft.dspark_model import DSparkModel
from dspark.train.features import target_features

KINDS = ("vanilla", "gated", "rnn")
ANCHORS = (20, 41, 63)  # anchor positions in the sequence (context: every position before)


@pytest.fixture(scope="module")
def target(smollm_fp32):
    return smollm_fp32[0]


@pytest.fixture(scope="module")
def sequence(base_llm_fp32, chat_ids, solo_greedy) -> list[int]:
    return chat_ids[0] + solo_greedy[0]


def drafter_of_kind(target, kind: str, seed: int = 0) -> DSparkModel:
    """The bundled DSpark drafter (vanilla head); for gated and RNN its weights with a head of that kind, the extra
    parameters drawn at random (seeded): a drafter of the real target's shapes."""
    bundled = load_drafter(DEFAULT_DRAFTER_DIR, target, dtype=torch.float32)
    if kind == "vanilla":
        return bundled
    torch.manual_seed(seed)
    model = DSparkModel({**bundled.config, "markov_head_type": kind}).float()
    missing, unexpected = model.load_state_dict(bundled.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(f"markov_head.{'gate' if kind == 'gated' else 'joint'}_proj")
                                  for k in missing)
    return model.eval()


def specforge_model(folder) -> DSparkDraftModel:
    """SpecForge's class built from the folder's config.json, its weights loaded strictly."""
    config = Qwen3Config(**json.loads((folder / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    model = DSparkDraftModel(config).float().eval()
    model.load_state_dict({k: v.float() for k, v in load_file(folder / "model.safetensors").items()}, strict=True)
    return model


def ours(model: DSparkModel, features: torch.Tensor, block: torch.Tensor, prev: torch.Tensor, anchor: int):
    """(logits with the Markov head [γ, V], confidence logits [γ]) of one block at `anchor`, its context every
    position before it, teacher-forced with the previous tokens prev [γ]."""
    ctx_kv = model.context_kv(model.context(features[:anchor]), torch.arange(anchor))

    def attend(layer, q, k, v):
        keys = torch.cat([ctx_kv[layer][0], k]).transpose(0, 1)
        values = torch.cat([ctx_kv[layer][1], v]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, enable_gqa=True)
        return out.transpose(0, 1).reshape(q.shape[0], -1)
    h = model.backbone(block, torch.arange(anchor, anchor + len(block)), attend)
    U = model.base_logits(h)
    state = model.markov_head.initial_state(1, h) if model.markov_head is not None else None
    logits, conf = [], []
    for k in range(len(block)):
        bias, c, state = model.head_step(prev[k:k + 1], h[k:k + 1], state)
        logits.append(U[k] + (0 if bias is None else bias[0]))
        conf.append(c)
    return torch.stack(logits), torch.cat(conf)


def theirs(model: DSparkDraftModel, target, features: torch.Tensor, block: torch.Tensor, prev: torch.Tensor,
           anchor: int):
    hidden = model(position_ids=torch.arange(anchor + len(block))[None], attention_mask=None,
                   noise_embedding=target.embed_tokens(block)[None].float(), target_hidden=features[None, :anchor])
    base = target.lm_head(hidden).float()
    logits = model.apply_logits_head(base, prev_token_ids=prev[None], hidden_states=hidden)
    return logits[0], model.predict_confidence(hidden, prev_token_ids=prev[None])[0]


def compare(ours_model, sf_model, target, sequence) -> dict:
    """Largest differences and top-token agreement over the blocks at ANCHORS."""
    ids = torch.tensor(sequence)
    features = target_features(target, [sequence], ours_model.target_layer_ids).features[0].float()
    worst = {"logits": 0.0, "probs": 0.0, "confidence": 0.0}
    agree = total = 0
    with torch.no_grad():
        for anchor in ANCHORS:
            G = ours_model.block_size
            block = ours_model.block_inputs(ids[anchor:anchor + 1])[0]
            prev = ids[anchor:anchor + G]  # x_{a+k-1}: the anchor, then the sequence's own tokens
            (lo, co), (lt, ct) = ours(ours_model, features, block, prev, anchor), theirs(sf_model, target, features,
                                                                                        block, prev, anchor)
            worst["logits"] = max(worst["logits"], (lo - lt).abs().max().item())
            worst["probs"] = max(worst["probs"], (lo.softmax(-1) - lt.softmax(-1)).abs().max().item())
            worst["confidence"] = max(worst["confidence"], (co.sigmoid() - ct.sigmoid()).abs().max().item())
            agree += int((lo.argmax(-1) == lt.argmax(-1)).sum())
            total += G
    return {**worst, "top_token_agreement": agree / total}


def check(figures: dict, what: str, report) -> None:
    report(f"{what}: max |Δlogit| {figures['logits']:.2e}, max |Δq| {figures['probs']:.2e}, max |Δconfidence| "
          f"{figures['confidence']:.2e}, top tokens agree at {figures['top_token_agreement']:.0%} of positions")
    assert figures["logits"] < 1e-3 and figures["probs"] < 1e-4 and figures["confidence"] < 1e-5
    assert figures["top_token_agreement"] == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_our_export_loads_strictly_in_specforge_and_agrees(target, sequence, kind, tmp_path, report):
    model = drafter_of_kind(target, kind)
    save_drafter(model, tmp_path, layout="specforge", dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["dflash_config"]["markov_head_type"] == kind
    assert not set(FROZEN) & set(load_file(tmp_path / "model.safetensors"))
    check(compare(model, specforge_model(tmp_path), target, sequence), f"dspark -> specforge ({kind})", report)


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafter_saved_by_specforge_loads_here_and_agrees(target, sequence, kind, tmp_path, report):
    """SpecForge's model, initialised at random by SpecForge (seeded) for the real target's shapes and saved with its
    save_pretrained, loads with load_drafter."""
    bundled = json.loads((DEFAULT_DRAFTER_DIR / "config.json").read_text())
    config = Qwen3Config(**{k: v for k, v in bundled.items() if k not in (
        "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
        "confidence_head_with_markov", "architectures")})
    config.architectures = ["DSparkDraftModel"]
    config.dflash_config = {"target_layer_ids": bundled["target_layer_ids"], "markov_rank": bundled["markov_rank"],
                            "markov_head_type": kind, "enable_confidence_head": True,
                            "confidence_head_with_markov": True}  # no mask id: SpecForge's inference never reads it
    config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    sf_model = DSparkDraftModel(config).float().eval()
    sf_model.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, target, dtype=torch.float32)
    assert loaded.c.markov_head_type == kind and loaded.mask_token_id == 16
    check(compare(loaded, sf_model, target, sequence), f"specforge -> dspark ({kind})", report)


def test_the_default_export_is_complete(target, tmp_path):
    """`dspark export` writes the deepspec layout with every weight (the target's embedding and LM head too), so a
    loader that takes all of them from the file finds none missing; the files are readable by others."""
    from dspark.cli import main

    assert main(["export", "--drafter", str(DEFAULT_DRAFTER_DIR), "--out", str(tmp_path), "--dtype", "fp32"]) == 0
    state = load_file(tmp_path / "model.safetensors")
    model = DSparkModel(json.loads((tmp_path / "config.json").read_text()))
    assert set(state) == set(model.state_dict())
    assert torch.equal(state["lm_head.weight"], target.lm_head.weight.float())
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o044 == 0o044, f"{name} is not readable by group and others"
    assert main(["export", "--drafter", str(DEFAULT_DRAFTER_DIR), "--out", str(tmp_path / "sf"), "--format",
                 "specforge"]) == 0
    assert load_drafter(tmp_path / "sf", target).c.markov_rank == model.c.markov_rank
