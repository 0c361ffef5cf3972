"""Training over a draft vocabulary (draft_vocab.TrainingVocab, `dspark train --draft-vocab N`): the loss's terms
over its columns equal the whole-vocabulary formula with q zero outside it, and their hand-written backward equals
finite differences; the whole vocabulary given as a draft vocabulary trains exactly as none; the training forward's
q over a draft vocabulary is the q that the drafter cut to it drafts from; the trainer writes the vocabulary beside
the weights, trains only its rows of W2, and resumes with it.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_draft_vocab import IDS
from test_drafter import committed_request, sequence
from test_eagle3 import tiny_eagle
from test_train import train_config, train_data
from tiny_models import VOCAB, one_thread, tiny_drafter, tiny_target, tiny_target_dir

from dspark import SamplingParams
from dspark.cli import main
from dspark.draft.draft_vocab import TrainingVocab, load_draft_vocab, restrict
from dspark.draft.dspark import DSparkDrafter
from dspark.draft.eagle3 import Eagle3Drafter
from dspark.train.anchors import AnchorBatch
from dspark.train.features import target_features
from dspark.train.forward import forward_for
from dspark.train.losses import CHUNK, RowTerms
from dspark.train.trainer import Trainer

__all__ = ["one_thread", "tiny_target", "tiny_target_dir", "train_data"]  # fixtures used here
pytestmark = pytest.mark.usefixtures("one_thread")


def test_row_terms_over_a_draft_vocabulary_equal_the_whole_vocabulary_formula():
    """CE and ‖q - p‖₁ from the vocabulary's columns and the whole vocabulary's log-normaliser equal the formula
    over the whole vocabulary with q = softmax(U + u W2ᵀ) there and zero elsewhere, p = softmax(t / T) (the
    target's mass outside counts), CE 0 for a label outside; the backward equals finite differences."""
    g = torch.Generator().manual_seed(0)
    N, V, r, T = 2 * CHUNK + 3, 13, 3, 0.7
    ids = torch.tensor([0, 2, 3, 7, 9, 12])
    vocab = TrainingVocab(ids, torch.nn.Linear(4, V, bias=False).double())
    t = torch.randn(N, V, generator=g, dtype=torch.double) * 2
    labels = torch.randint(V, (N,), generator=g)
    U = torch.randn(N, len(ids), generator=g, dtype=torch.double).requires_grad_()
    u = torch.randn(N, r, generator=g, dtype=torch.double).requires_grad_()
    w2 = torch.randn(len(ids), r, generator=g, dtype=torch.double).requires_grad_()
    t_cols, cols, lse = vocab.columns(t, labels, T)
    assert torch.equal(t_cols, t[:, ids]) and bool((cols >= 0).any()) and bool((cols < 0).any())
    ce, l1 = RowTerms.apply(U, t_cols, cols, T, u, w2, lse)
    z = U + u @ w2.t()
    q = torch.zeros(N, V, dtype=torch.double)
    q[:, ids] = z.detach().softmax(-1)
    p = (t / T).softmax(-1)
    torch.testing.assert_close(l1.detach(), (q - p).abs().sum(-1), rtol=1e-6, atol=1e-6)
    inside = torch.isin(labels, ids)
    want_ce = -q.gather(-1, labels[:, None]).squeeze(-1).log()
    torch.testing.assert_close(ce.detach()[inside], want_ce[inside])
    assert not ce[~inside].any()
    assert torch.autograd.gradcheck(lambda *x: RowTerms.apply(x[0], t_cols, cols, T, *x[1:], lse), (U, u, w2))


@pytest.mark.parametrize("kind", ["vanilla", "eagle3"])
def test_the_whole_vocabulary_as_a_draft_vocabulary_trains_as_none(tiny_target, kind):
    model = tiny_eagle(tiny_target) if kind == "eagle3" else tiny_drafter(tiny_target, kind, seed=3)
    seqs = [sequence(24, 1), sequence(24, 2)]
    feats = target_features(tiny_target, seqs, model.target_layer_ids)
    anchors = AnchorBatch(torch.tensor([[4, 12], [9, 15]]), torch.ones(2, 2, dtype=torch.bool), model.block_size)
    results = []
    for vocab in (None, TrainingVocab(torch.arange(VOCAB), model.lm_head)):
        model.zero_grad(set_to_none=True)
        parts = forward_for(model)(model, tiny_target, torch.tensor(seqs), feats, anchors, vocab=vocab).loss()
        parts.total.backward()
        results.append((parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (a, ga), (b, gb) = results
    for name in ("total", "ce", "tv", "conf", "tau"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-6)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["vanilla", "dflash", "eagle3", "mtp"])
def test_training_q_over_a_draft_vocabulary_is_what_the_cut_drafter_drafts_from(tiny_target, kind):
    """The teacher-forced forward over the draft vocabulary (the drafts spliced in after the anchor) gives the q
    and confidences that the drafter cut to the same vocabulary drafted from at temperature 1; its p is the
    target's whole-vocabulary distribution at those columns."""
    eagle = kind in ("eagle3", "mtp")

    def make():
        return tiny_eagle(tiny_target, kind, seed=3) if eagle else tiny_drafter(tiny_target, kind, seed=3)

    trained, cut = make(), make()
    restrict(cut, IDS)
    drafter = Eagle3Drafter(cut) if eagle else DSparkDrafter(cut)
    seq, a, G = sequence(24, 4), 11, cut.block_size
    feats = target_features(tiny_target, [seq], cut.target_layer_ids)
    got = drafter.propose([committed_request(drafter, 0, feats.features[0, :a], seq[a],
                                             SamplingParams(temperature=1.0, seed=5), context=seq[:a])])
    spliced = seq[:a + 1] + got.tokens[0].tolist() + seq[a + 1 + G:]
    out = forward_for(trained)(trained, tiny_target, torch.tensor([spliced]), feats,
                               AnchorBatch(torch.tensor([[a]]), torch.tensor([[True]]), G),
                               vocab=TrainingVocab(IDS, trained.lm_head))
    torch.testing.assert_close(out.logits.softmax(-1), got.q[..., IDS], rtol=1e-4, atol=1e-6)
    if out.conf_logits is not None:
        torch.testing.assert_close(torch.sigmoid(out.conf_logits), got.confidence, rtol=1e-5, atol=1e-6)
    whole = tiny_target.logits(feats.hidden[0, a:a + G]).softmax(-1)
    torch.testing.assert_close(out.p[0], whole[:, IDS], rtol=1e-5, atol=1e-7)


def test_trainer_writes_its_draft_vocabulary_and_trains_only_its_rows(tiny_target_dir, train_data, tmp_path,
                                                                       capsys):
    """The vocabulary is the end id and the most frequent tokens of the training answers (held-out ones left out),
    written beside the weights (marked as trained over, so `dspark draft-vocab` will not replace it); W2 starts at
    zero and only its rows move; a resumed run reads it back and refuses another size, none, or one where the run
    began over the whole vocabulary."""
    cfg = train_config(train_data, tmp_path / "run", tiny_target_dir, markov_head_type="vanilla", draft_vocab=32,
                       steps=2)
    trainer = Trainer(cfg)
    trainer.fit()
    held_out = {r["id"] for r in trainer.eval_recs}
    records = [json.loads(line) for line in open(train_data)]
    answers = [r["answer_ids"] for r in records if r["id"] not in held_out]
    assert held_out and len(answers) == len(records) - len(held_out)
    counts = torch.bincount(torch.tensor([t for a in answers for t in a]), minlength=VOCAB)
    ids = load_draft_vocab(tmp_path / "run", VOCAB)
    assert ids is not None and len(ids) == 32 and 1 in ids.tolist()  # the end id always
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert counts[ids[ids != 1]].min() >= counts[outside].max()
    w2 = load_file(tmp_path / "run" / "model.safetensors")["markov_head.markov_w2.weight"]
    assert not w2[outside].any() and bool(w2[ids].any())
    resumed = Trainer(train_config(train_data, tmp_path / "run", tiny_target_dir, markov_head_type="vanilla",
                                   draft_vocab=32, steps=2))
    assert resumed.step == 2 and torch.equal(resumed.vocab.ids, ids)
    assert json.loads((tmp_path / "run" / "draft_vocab.json").read_text())["trained"] is True
    for size, refusal in ((48, "holds 32 tokens"), (0, "--draft-vocab 32")):
        with pytest.raises(ValueError, match=refusal):
            Trainer(train_config(train_data, tmp_path / "run", tiny_target_dir, markov_head_type="vanilla",
                                 draft_vocab=size, steps=2))
    assert main(["draft-vocab", "--drafter", str(tmp_path / "run"), "--data", str(train_data), "--size", "16"]) == 2
    assert "trained over a draft vocabulary" in capsys.readouterr().err  # dspark draft-vocab keeps it
    assert torch.equal(load_draft_vocab(tmp_path / "run", VOCAB), ids)
    whole = tmp_path / "whole"
    Trainer(train_config(train_data, whole, tiny_target_dir, markov_head_type="vanilla", steps=1)).fit()
    with pytest.raises(ValueError, match="over the whole vocabulary"):
        Trainer(train_config(train_data, whole, tiny_target_dir, markov_head_type="vanilla", draft_vocab=32, steps=1))


def test_the_feature_caches_log_normaliser_trains_like_the_online_one(tiny_target_dir, train_data, tmp_path):
    """`dspark features` stores the target logits' log-normaliser per position; training over a draft vocabulary
    from that cache (only the vocabulary's rows of the LM head run) gives the losses and gradients of online
    features. A cache begun without it (no "lse" in its index) still trains, computing it."""
    cache = tmp_path / "cache"
    assert main(["features", "--data", str(train_data), "--out", str(cache), "--target", str(tiny_target_dir),
                 "--max-len", "64", "--batch-size", "3"]) == 0

    def trainer(name, **fields):
        return Trainer(train_config(train_data, tmp_path / name, tiny_target_dir, target_dtype="bf16",
                                    markov_head_type="vanilla", draft_vocab=32, **fields))

    online, cached = trainer("online"), trainer("cached", feature_cache=str(cache))
    recs = online.batch_records(0)
    feats = cached.cache.features(recs)
    for i, n in enumerate(feats.lengths):
        whole = online.target.logits(feats.hidden[i, :n], dtype=None).float().logsumexp(-1)
        torch.testing.assert_close(feats.lse[i, :n], whole, rtol=0, atol=1e-5)
    def refuse(*args, **kwargs):
        raise AssertionError("the whole LM head ran although the cache holds the log-normaliser")

    cached.target.logits = refuse
    results = []
    for run in (online, cached):
        parts = run.losses(recs, 0)
        parts.total.backward()
        results.append((parts, {n: p.grad.clone() for n, p in run.model.named_parameters() if p.requires_grad}))
    (a, ga), (b, gb) = results
    for name in ("total", "ce", "tv", "conf", "tau"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=2e-3, atol=1e-4)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=2e-2, atol=1e-4)
    index = json.loads((cache / "index.json").read_text())
    del index["lse"]
    (cache / "index.json").write_text(json.dumps(index))
    old = trainer("old", feature_cache=str(cache))
    assert old.cache.features(recs).lse is None
    torch.testing.assert_close(old.losses(recs, 0).total, a.total, rtol=2e-3, atol=1e-4)
