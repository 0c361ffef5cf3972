"""Drafter training (docs/method.md §3) on a tiny random target: anchors and the block attention mask, the
isolation of packed blocks, the loss against a hand computation, exact resume after a kill, and
multi-process (DDP) training equal to one process.

Sections: anchors and masks | block isolation | loss | trainer.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import (BLOCK, VOCAB, one_thread, random_tokens, tiny_drafter, tiny_target, tiny_target_dir,
                         write_train_data)

from dspark.train.anchors import AnchorBatch, sample_anchors
from dspark.train.features import target_features
from dspark.train.forward import block_forward
from dspark.train.losses import CHUNK, RowTerms, dspark_loss
from dspark.train.trainer import TrainConfig, Trainer, main_train

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]  # fixtures used here
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- anchors and masks ----------------------------------------------------------------------------
def test_anchor_mask_sees_earlier_context_and_its_own_block_only():
    anchors = AnchorBatch(torch.tensor([[2, 5], [0, 3]]), torch.ones(2, 2, dtype=torch.bool), block_size=3)
    L, N, G = 8, 2, 3
    mask = anchors.mask(L)
    assert mask.shape == (2, 1, N * G, L + N * G)
    for b in range(2):
        for n in range(N):
            for k in range(G):
                row = mask[b, 0, n * G + k]
                context = [j < anchors.anchors[b, n] for j in range(L)]
                blocks = [m == n for m in range(N) for _ in range(G)]
                assert row.tolist() == context + blocks, (b, n, k)


def test_sampled_anchors_are_distinct_sorted_and_leave_room_for_a_block():
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    lengths, starts = [30, 12, 9], [4, 3, 6]
    batch = sample_anchors(lengths, starts, num_anchors=5, block_size=4, generators=gens)
    assert batch.anchors.shape == (3, 5)
    assert batch.valid.sum(1).tolist() == [5, 5, 0]  # 12 - 1 - 4 = 7: anchors 3..7; 9 - 1 - 4 < 6: none
    for row, ok, n, s in zip(batch.anchors, batch.valid, lengths, starts):
        picked = row[ok].tolist()
        assert picked == sorted(set(picked)) and all(s <= a <= n - 1 - 4 for a in picked)
    again = sample_anchors(lengths, starts, 5, 4, [torch.Generator().manual_seed(i) for i in range(3)])
    assert torch.equal(again.anchors, batch.anchors)  # seeded: a resumed run draws the same anchors


# ---- block isolation ------------------------------------------------------------------------------
def run_blocks(model, target, seqs, anchor_rows, feats=None):
    feats = feats or target_features(target, seqs, model.target_layer_ids)
    rows = torch.tensor(anchor_rows)
    anchors = AnchorBatch(rows, torch.ones_like(rows, dtype=torch.bool), model.block_size)
    return block_forward(model, target, torch.tensor(seqs), feats, anchors)


@pytest.fixture
def seq():
    return random_tokens(32, torch.Generator().manual_seed(0))


def test_context_keys_come_only_from_committed_positions(tiny_target, seq):
    """Features at positions >= a never reach the block at anchor a; the feature at a - 1 does."""
    model = tiny_drafter(tiny_target, "rnn")
    a = 12
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    base = run_blocks(model, tiny_target, [seq], [[a]], feats)
    g = torch.Generator().manual_seed(1)
    feats.features[0, a:] = torch.randn(feats.features[0, a:].shape, generator=g) * 10
    later = run_blocks(model, tiny_target, [seq], [[a]], feats)
    assert torch.equal(later.logits, base.logits) and torch.equal(later.conf_logits, base.conf_logits)
    feats.features[0, a - 1] += 1.0
    earlier = run_blocks(model, tiny_target, [seq], [[a]], feats)
    assert not torch.allclose(earlier.logits, base.logits)


def test_a_block_never_sees_another_block(tiny_target, seq):
    """Packed with overlapping and distant blocks, a block's outputs are those it has alone; changing the
    tokens of another block changes that block and leaves this one bit-identical."""
    model = tiny_drafter(tiny_target, "gated")
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    alone = run_blocks(model, tiny_target, [seq], [[5]], feats)
    packed = run_blocks(model, tiny_target, [seq], [[5, 6, 7, 20]], feats)
    torch.testing.assert_close(packed.logits[0], alone.logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.conf_logits[0], alone.conf_logits[0], rtol=1e-5, atol=1e-6)
    changed = list(seq)
    for pos in range(20, 20 + BLOCK):  # the tokens of the block at anchor 20 (anchor and teacher-forced inputs)
        changed[pos] = (seq[pos] + 7) % VOCAB
    other = run_blocks(model, tiny_target, [changed], [[5, 6, 7, 20]], feats)
    assert torch.equal(other.logits[:3], packed.logits[:3])
    assert torch.equal(other.conf_logits[:3], packed.conf_logits[:3])
    assert not torch.allclose(other.logits[3], packed.logits[3])


def test_training_distribution_p_is_the_targets_next_token_distribution(tiny_target, seq):
    """p_k of the block at a is the target's distribution after x_0..x_{a+k-1}, labels are x_{a+k}."""
    model = tiny_drafter(tiny_target, "vanilla")
    out = run_blocks(model, tiny_target, [seq], [[9]])
    feats = target_features(tiny_target, [seq[:9 + BLOCK]], model.target_layer_ids)
    want = tiny_target.logits(feats.hidden[0, 9:9 + BLOCK]).softmax(-1)
    torch.testing.assert_close(out.p[0], want, rtol=1e-4, atol=1e-6)
    assert out.labels[0].tolist() == seq[10:10 + BLOCK]


# ---- loss -----------------------------------------------------------------------------------------
def hand_loss(logits, p, labels, conf_logits, valid):
    """docs/method.md §3 with plain Python loops: (total, ce, tv, conf, tau) averaged over valid blocks."""
    M, G, V = logits.shape
    sums = {"ce": 0.0, "tv": 0.0, "conf": 0.0, "tau": 0.0}
    for m in range(M):
        if not valid[m]:
            continue
        survive, tau = 1.0, 1.0
        for k in range(G):
            w = math.exp(-k / G)  # w_k = exp(-(k-1)/γ) for k = 1..γ
            z = [float(x) for x in logits[m, k]]
            norm = math.log(sum(math.exp(x) for x in z))
            q = [math.exp(x - norm) for x in z]
            l1 = sum(abs(q[v] - float(p[m, k, v])) for v in range(V))
            c_star = min(1.0, max(0.0, 1 - l1 / 2))
            c = 1 / (1 + math.exp(-float(conf_logits[m, k])))
            sums["ce"] += w * -math.log(q[int(labels[m, k])])
            sums["tv"] += w * l1
            sums["conf"] += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
            survive *= c_star
            tau += survive
        sums["tau"] += tau
    n = sum(bool(v) for v in valid)
    parts = {k: v / n for k, v in sums.items()}
    parts["total"] = 0.1 * parts["ce"] + 0.9 * parts["tv"] + 1.0 * parts["conf"]
    return parts


def test_loss_equals_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    M, G, V = 3, 4, 6
    logits = (torch.randn(M, G, V, generator=g) * 2).requires_grad_()
    p = (torch.randn(M, G, V, generator=g) * 2).softmax(-1)
    p[0, 1] = logits[0, 1].detach().softmax(-1)  # q == p: c* = 1 exactly
    labels = torch.randint(V, (M, G), generator=g)
    conf_logits = torch.randn(M, G, generator=g).requires_grad_()
    valid = torch.tensor([True, False, True])
    parts = dspark_loss(logits, p.log(), labels, conf_logits, valid)  # the target's logits: log p
    want = hand_loss(logits.detach(), p, labels, conf_logits.detach(), valid)
    for name in ("total", "ce", "tv", "conf", "tau"):
        assert getattr(parts, name).item() == pytest.approx(want[name], rel=1e-5), name
    parts.conf.backward()  # c* is a label: the confidence loss sends no gradient into q
    assert logits.grad is None or not logits.grad.any()
    assert conf_logits.grad[1].abs().sum() == 0 and conf_logits.grad[0].abs().sum() > 0  # invalid block ignored


def test_row_terms_backward_equals_the_numerical_gradient():
    """RowTerms' hand-written, chunked backward of CE and ‖q - p‖₁ against finite differences (float64), over
    more rows than a chunk, with upstream gradients that differ per row and per term: q = softmax(U) and,
    with the Markov head's low-rank bias, q = softmax(U + u W2ᵀ) with the gradients of U, u and W2; p from
    the target's logits at temperature 1 and 0.7."""
    g = torch.Generator().manual_seed(0)
    N, V, r = 2 * CHUNK + 3, 11, 3
    U = torch.randn(N, V, generator=g, dtype=torch.double).requires_grad_()
    t = torch.randn(N, V, generator=g, dtype=torch.double)
    labels = torch.randint(V, (N,), generator=g)
    assert torch.autograd.gradcheck(lambda U: RowTerms.apply(U, t, labels, 1.0), (U,))
    u = torch.randn(N, r, generator=g, dtype=torch.double).requires_grad_()
    w2 = torch.randn(V, r, generator=g, dtype=torch.double).requires_grad_()
    assert torch.autograd.gradcheck(lambda *x: RowTerms.apply(x[0], t, labels, 0.7, *x[1:]), (U, u, w2))


def test_row_terms_from_bf16_logits_match_the_float32_formula():
    """From bf16 LM-head outputs (as on the default target) the terms equal the float32 formula on the same
    values: CE and ‖softmax(U + u W2ᵀ) - softmax(t / T)‖₁ and their gradients."""
    g = torch.Generator().manual_seed(1)
    N, V, r, T = CHUNK + 5, 300, 4, 0.8
    U = (torch.randn(N, V, generator=g) * 3).bfloat16().requires_grad_()
    t = (torch.randn(N, V, generator=g) * 3).bfloat16()
    u, w2 = (torch.randn(n, r, generator=g).requires_grad_() for n in (N, V))
    labels = torch.randint(V, (N,), generator=g)
    gc, gl = torch.rand(N, generator=g), torch.rand(N, generator=g)
    ce, l1 = RowTerms.apply(U, t, labels, T, u, w2)
    ((ce * gc).sum() + (l1 * gl).sum()).backward()
    got = [ce, l1, U.grad.float(), u.grad, w2.grad]
    for x in (U, u, w2):
        x.grad = None
    z = U.float() + u @ w2.t()
    want_ce = -z.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    want_l1 = (z.softmax(-1) - (t.float() / T).softmax(-1)).abs().sum(-1)
    ((want_ce * gc).sum() + (want_l1 * gl).sum()).backward()
    for a, b in zip(got, [want_ce, want_l1, U.grad.float(), u.grad, w2.grad]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- trainer --------------------------------------------------------------------------------------
STEPS = 3  # the killed run stops during step STEPS + 1 of 2 * STEPS


class Killed(Exception):
    pass


def train_config(data, out, target_dir, **fields) -> TrainConfig:
    base = dict(target=str(target_dir), target_dtype="fp32", num_layers=1, block_size=BLOCK, markov_rank=8,
                markov_head_type="rnn", num_anchors=4, max_len=64, batch_size=4, steps=2 * STEPS, lr=3e-3,
                warmup=2, save_every=1, eval_every=100, eval_sequences=2)
    return TrainConfig(data=str(data), out=str(out), **{**base, **fields})


@pytest.fixture(scope="module")
def train_data(tmp_path_factory, tiny_target_dir):
    """12 records of 3..9 prompt and 6..40 answer tokens: some give no anchor, most fewer than a full set."""
    lengths = [(3 + i % 7, 6 + (i * 11) % 35) for i in range(12)]
    return write_train_data(tmp_path_factory.mktemp("data") / "regen.jsonl", lengths)


def trainable_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)


def test_resume_after_a_kill_continues_with_identical_state(tiny_target_dir, train_data, tmp_path):
    whole = Trainer(train_config(train_data, tmp_path / "whole", tiny_target_dir))
    whole.fit()
    cfg = train_config(train_data, tmp_path / "killed", tiny_target_dir)
    first = Trainer(cfg)
    calls = {"n": 0}
    real_step = first.opt.step

    def step_then_die(*args, **kwargs):  # killed during step STEPS + 1, after its backward
        calls["n"] += 1
        if calls["n"] > STEPS:
            raise Killed
        return real_step(*args, **kwargs)

    first.opt.step = step_then_die
    with pytest.raises(Killed):
        first.fit()
    resumed = Trainer(cfg)
    assert resumed.step == STEPS
    assert resumed.model.embed_tokens.weight is resumed.target.embed_tokens.weight
    resumed.fit()
    assert resumed.step == whole.step == 2 * STEPS
    mine, theirs = trainable_state(resumed), trainable_state(whole)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    assert_same_optimizer_state(resumed.opt, whole.opt)
    for name, tensor in load_file(tmp_path / "killed" / "model.safetensors").items():
        assert torch.equal(tensor, theirs[name]), name
    log = [json.loads(line) for line in (tmp_path / "killed" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, 2 * STEPS + 1))
    assert not torch.equal(mine["fc.weight"], first.model.fc.weight)  # training moved the weights on


WORKER = """
import json, sys
import torch
torch.set_num_threads(1)
from dspark.train.trainer import TrainConfig, main_train
main_train(TrainConfig(**json.loads(sys.argv[1])))
"""


@pytest.mark.slow
def test_two_process_training_equals_one_process(tiny_target_dir, train_data, tmp_path):
    """torchrun with 2 processes (gloo) and one process on the same global batch of 4 sequences reach
    the same weights after a few steps (the blocks are split unevenly between the two processes) and log the same
    losses and acceptance."""
    single = train_config(train_data, tmp_path / "single", tiny_target_dir, steps=STEPS)
    main_train(single)
    ddp = train_config(train_data, tmp_path / "ddp", tiny_target_dir, steps=STEPS)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), json.dumps(asdict(ddp))], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = load_file(tmp_path / "single" / "model.safetensors"), load_file(tmp_path / "ddp" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:  # per tensor: float sums run in another order, and Adam divides by tiny moments
        assert (two[name] - one[name]).norm() <= 1e-5 * one[name].norm(), name
    logs = [[json.loads(r) for r in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]
            for run in ("single", "ddp")]
    for a, b in zip(*logs):  # the logged figures are the whole global batch's, not rank 0's share
        for key in ("loss", "ce", "tv", "conf", "tau_est"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)


def test_feature_cache_trains_exactly_like_online_features(tiny_target_dir, train_data, tmp_path):
    """A bf16 target: training from `dspark features`' cache gives the same weights as online features; a
    cache without the drafter's layers is refused."""
    from dspark.cli import main

    cache = tmp_path / "cache"
    assert main(["features", "--data", str(train_data), "--out", str(cache), "--target", str(tiny_target_dir),
                 "--max-len", "64", "--batch-size", "3"]) == 0
    online = Trainer(train_config(train_data, tmp_path / "online", tiny_target_dir, target_dtype="bf16", steps=2))
    cached = Trainer(train_config(train_data, tmp_path / "cached", tiny_target_dir, target_dtype="bf16", steps=2,
                                  feature_cache=str(cache)))
    recs = online.batch_records(0)
    a = target_features(online.target, [r["ids"] for r in recs], online.model.target_layer_ids)
    b = cached.cache.features(recs)
    assert torch.equal(a.features, b.features) and torch.equal(a.hidden, b.hidden) and a.lengths == b.lengths
    online.fit()
    cached.fit()
    for name, tensor in trainable_state(online).items():
        assert torch.equal(trainable_state(cached)[name], tensor), name
    partial = tmp_path / "partial"
    assert main(["features", "--data", str(train_data), "--out", str(partial), "--target", str(tiny_target_dir),
                 "--max-len", "64", "--layers", "1,2"]) == 0
    with pytest.raises(ValueError, match="layers"):
        Trainer(train_config(train_data, tmp_path / "x", tiny_target_dir, target_dtype="bf16", feature_cache=str(partial)))


def test_export_writes_bf16_weights_with_the_training_record(tiny_target_dir, train_data, tmp_path):
    from dspark.cli import main
    from dspark.draft.checkpoint import load_drafter
    from dspark.target.loading import load_target

    Trainer(train_config(train_data, tmp_path / "run", tiny_target_dir, steps=2)).fit()
    assert main(["draft-vocab", "--drafter", str(tmp_path / "run"), "--data", str(train_data), "--size", "48"]) == 0
    assert main(["export", "--drafter", str(tmp_path / "run"), "--out", str(tmp_path / "ship"), "--trainable-only",
                 "--target", str(tiny_target_dir)]) == 0
    assert (tmp_path / "ship" / "draft_vocab.json").read_text() == (tmp_path / "run" / "draft_vocab.json").read_text()
    weights = load_file(tmp_path / "ship" / "model.safetensors")
    assert "embed_tokens.weight" not in weights and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert json.loads((tmp_path / "ship" / "training.json").read_text())["step"] == 2
    assert len((tmp_path / "ship" / "train_log.jsonl").read_text().splitlines()) == 2
    target = load_target(str(tiny_target_dir), torch.float32)[0]
    trained = load_drafter(tmp_path / "run", target)
    shipped = load_drafter(tmp_path / "ship", target, dtype=torch.float32)
    assert torch.equal(shipped.fc.weight, trained.fc.weight.bfloat16().float())
    assert main(["export", "--drafter", str(tmp_path / "run"), "--out", str(tmp_path / "full"),
                 "--target", str(tiny_target_dir)]) == 0  # the default: complete
    assert "lm_head.weight" in load_file(tmp_path / "full" / "model.safetensors")


def test_train_command_with_bf16_autocast(tiny_target_dir, train_data, tmp_path, capsys):
    """`dspark train --autocast-bf16 1` trains (the switch reaches torch.autocast as a bool) and records the
    setting; a value other than 0 or 1 is refused by the parser."""
    from dspark.cli import main

    argv = ["train", "--data", str(train_data), "--target", str(tiny_target_dir), "--num-layers", "1",
            "--markov-rank", "8", "--num-anchors", "4", "--max-len", "64", "--steps", "2", "--eval-sequences", "2"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--autocast-bf16", "1"]) == 0
    assert torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)["config"]["autocast_bf16"] is True
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path / "bad"), "--autocast-bf16", "yes"])
    assert "expected 0 or 1" in capsys.readouterr().err
