"""The Eagle3-style drafter and MTP-1 (baselines) on the tiny random target: inference agrees with the
unrolled teacher-forced training forward, a draft step never reads later tokens, checkpoints round-trip,
the engine stays lossless, and the trainer trains them."""
from __future__ import annotations

import json

import pytest
import torch
from test_drafter import committed_request, sequence
from test_train import train_config, train_data  # noqa: F401  (fixture)
from tiny_models import BLOCK, VOCAB, one_thread, tiny_target, tiny_target_dir

from dspark import LLM, SamplingParams
from dspark.draft import make_drafter
from dspark.draft.checkpoint import load_drafter, save_drafter
from dspark.draft.eagle3 import Eagle3Drafter
from dspark.draft.eagle3_model import Eagle3Model, eagle3_config
from dspark.train.anchors import AnchorBatch
from dspark.train.features import target_features
from dspark.train.forward import eagle3_forward
from dspark.train.trainer import Trainer

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]
pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = ("eagle3", "mtp")


def tiny_eagle(target, kind: str = "eagle3", seed: int = 0) -> Eagle3Model:
    torch.manual_seed(seed)
    model = Eagle3Model(eagle3_config(target.config.to_dict(), block_size=BLOCK, mtp=kind == "mtp")).float()
    model.embed_tokens.weight, model.lm_head.weight = target.embed_tokens.weight, target.lm_head.weight
    return model


def unrolled(model, target, seqs, anchors, feats=None):
    feats = feats or target_features(target, seqs, model.target_layer_ids)
    rows = torch.tensor([[a] for a in anchors])
    return eagle3_forward(model, target, torch.tensor(seqs), feats,
                          AnchorBatch(rows, torch.ones_like(rows, dtype=torch.bool), model.block_size))


@pytest.mark.parametrize("kind", KINDS)
def test_config_and_layout(tiny_target, kind, tmp_path):
    model = tiny_eagle(tiny_target, kind)
    assert model.target_layer_ids == ((5,) if kind == "mtp" else (1, 2, 3))
    assert model.block_size == (1 if kind == "mtp" else BLOCK)
    save_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["drafter_type"] == kind
    names = set(load_drafter(tmp_path, tiny_target).state_dict())
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"} <= names
    assert model.midlayer.self_attn.q_proj.weight.shape[1] == 2 * model.c.hidden_size


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_is_bit_exact(tiny_target, kind, tmp_path):
    model = tiny_eagle(tiny_target, kind, seed=3)
    loaded = load_drafter(save_drafter(model, tmp_path), tiny_target)
    assert isinstance(loaded, Eagle3Model) and loaded.lm_head.weight is tiny_target.lm_head.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert isinstance(make_drafter(str(tmp_path), target=tiny_target), Eagle3Drafter)


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_matches_unrolled_training_forward(tiny_target, kind):
    """Two requests drafted in one batch (contexts committed in pieces) give the q_1..q_γ of the unrolled
    training forward over their sequences with the drafts spliced in after the anchor."""
    model = tiny_eagle(tiny_target, kind, seed=1)
    drafter, G = Eagle3Drafter(model), model.block_size
    seqs, anchors = [sequence(24, 1), sequence(24, 2)], [10, 15]
    feats = target_features(tiny_target, seqs, model.target_layer_ids)
    reqs = [committed_request(drafter, i, feats.features[i, :a], seqs[i][a], SamplingParams(temperature=1.0, seed=i),
                              chunks=3, context=seqs[i][:a]) for i, a in enumerate(anchors)]
    proposal = drafter.propose(reqs)
    assert proposal.tokens.shape == (2, G) and proposal.confidence is None
    spliced = [s[:a + 1] + proposal.tokens[i].tolist() + s[a + 1 + G:] for i, (s, a) in enumerate(zip(seqs, anchors))]
    out = unrolled(model, tiny_target, spliced, anchors, feats)
    torch.testing.assert_close(out.logits.softmax(-1), proposal.q, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(2, G), rtol=0, atol=1e-5)


def test_a_step_never_reads_later_tokens_or_features(tiny_target):
    """q_k depends on x_{a+k-1} and earlier only: changing x_{a+k} or any feature at >= a leaves q_1..q_k."""
    model = tiny_eagle(tiny_target, seed=2)
    seq, a, G = sequence(24, 3), 9, BLOCK
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    base = unrolled(model, tiny_target, [seq], [a], feats).logits[0]
    for k in range(1, G):
        changed = list(seq)
        changed[a + k] = (seq[a + k] + 5) % VOCAB
        other = unrolled(model, tiny_target, [changed], [a], feats).logits[0]
        assert torch.equal(other[:k], base[:k]) and not torch.allclose(other[k], base[k])
    feats.features[0, a:] += 3.0
    assert torch.equal(unrolled(model, tiny_target, [seq], [a], feats).logits[0], base)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_with_eagle3_drafter_is_lossless_under_greedy(tiny_target, tiny_target_dir, kind):
    prompts = [sequence(9, 20), sequence(5, 21), sequence(13, 22)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 11, 17)]
    plain = LLM(str(tiny_target_dir), dtype="fp32").generate(prompts, greedy)
    drafter = Eagle3Drafter(tiny_eagle(tiny_target, kind, seed=4))
    llm = LLM(str(tiny_target_dir), drafter=drafter, gamma=BLOCK, dtype="fp32")
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert drafter.context_len == {} and drafter.last_g == {} and drafter.pending == {}
    assert sum(sum(s.verified) for s in llm.engine.stats) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_trains_eagle3_and_mtp(tiny_target_dir, train_data, tmp_path, kind):  # noqa: F811
    trainer = Trainer(train_config(train_data, tmp_path, tiny_target_dir, drafter_type=kind, steps=4, lr=1e-2))
    assert isinstance(trainer.model, Eagle3Model)
    before = trainer.losses(trainer.train_recs[:4], 0).total.item()
    trainer.fit()
    after = trainer.losses(trainer.train_recs[:4], 0).total.item()
    assert after < before
    resumed = Trainer(train_config(train_data, tmp_path, tiny_target_dir, drafter_type=kind, steps=4, lr=1e-2))
    assert resumed.step == 4 and isinstance(resumed.model, Eagle3Model)
