"""Draft vocabularies (draft_vocab.py): the most frequent answer tokens; a drafter cut to them drafts only
them, from q = (at temperature 1) its full-vocabulary distribution renormalised over them, zero elsewhere, for
DSpark and Eagle3-style drafters alike; decoding with it stays lossless (greedy equality here; the committed
drafters' tests in test_trained_drafters run with their draft vocabularies; that a q which is zero where p is not
keeps sampling exact is test_lossless_distribution's q_far setting and its real-model drafter, whose q lives on the
target's top tokens); files are checked.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_drafter import committed_request, sequence
from test_eagle3 import tiny_eagle
from tiny_models import FIRST_TOKEN, VOCAB, one_thread, tiny_drafter, tiny_target, tiny_target_dir, write_train_data

from dspark import LLM, SamplingParams
from dspark.cli import main
from dspark.draft.checkpoint import save_drafter
from dspark.draft.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab, most_frequent, restrict, save_draft_vocab
from dspark.draft.dspark import DSparkDrafter
from dspark.draft.eagle3 import Eagle3Drafter
from dspark.train.features import target_features

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]
pytestmark = pytest.mark.usefixtures("one_thread")

SUBSET = torch.arange(FIRST_TOKEN, VOCAB, 3)  # every third ordinary token, and the eos id 1
IDS = torch.cat([torch.tensor([1]), SUBSET])


def test_most_frequent_ranks_by_count_then_id_and_keeps_the_end_ids():
    answers = [[20 + i] * (20 - i) for i in range(20)] + [[19] * 6]  # 34 and 19 tie at 6
    assert most_frequent(answers, 16, 64) == list(range(19, 35))  # ties to the smaller id: 19 and 34 both fit
    assert most_frequent(answers, 16, 64, always=[1]) == [1, *range(19, 34)]  # the end id displaces 34
    assert most_frequent([[40, 40, 41, 42]], 16, 64) == [*range(13), 40, 41, 42]  # filled with unseen ids
    for size, bad in ((10, [[3]]), (80, [[3]]), (16, [[70]])):
        with pytest.raises(ValueError, match="multiple of 16|must lie"):
            most_frequent(bad, size, 64)


def test_draft_vocab_files_are_checked(tmp_path, monkeypatch, use_options):
    assert load_draft_vocab(tmp_path, VOCAB) is None  # no file: the whole vocabulary
    save_draft_vocab(tmp_path, [3, 8, 20], {"data": "x"})
    assert load_draft_vocab(tmp_path, VOCAB).tolist() == [3, 8, 20]
    use_options(draft_vocab=False)
    assert load_draft_vocab(tmp_path, VOCAB) is None
    use_options(draft_vocab=True)
    for bad in ([8, 3], [3, 3], [3, VOCAB], []):
        save_draft_vocab(tmp_path, bad, {})
        with pytest.raises(ValueError, match="sorted, distinct"):
            load_draft_vocab(tmp_path, VOCAB)


@pytest.mark.parametrize("kind", ["vanilla", "dflash", "eagle3"])
def test_cut_drafter_samples_its_vocabulary_from_the_renormalised_q(tiny_target, kind, monkeypatch):
    """Same weights, same seeds: the cut drafter's q is the whole drafter's q (for the same earlier drafts)
    renormalised over the draft vocabulary, zero elsewhere, and its drafts lie in it."""
    def drafter(model):
        return Eagle3Drafter(model) if kind == "eagle3" else DSparkDrafter(model)

    def make():
        return tiny_eagle(tiny_target) if kind == "eagle3" else tiny_drafter(tiny_target, kind, seed=3)

    whole, cut = drafter(make()), drafter(make())
    restrict(cut.model, IDS)
    seq, a = sequence(24, 4), 11
    feats = target_features(tiny_target, [seq], whole.model.target_layer_ids).features[0, :a]
    params = SamplingParams(temperature=1.0, seed=7)
    got = cut.propose([committed_request(cut, 0, feats, seq[a], params)])
    assert bool(torch.isin(got.tokens, IDS).all())
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[IDS] = False
    assert float(got.q[..., outside].abs().max()) == 0.0
    torch.testing.assert_close(got.q.sum(-1), torch.ones(got.q.shape[:2]))
    # the whole drafter, forced along the cut drafter's drafts (sampling the drafts it was given)
    forced = iter(got.tokens[0].tolist())
    monkeypatch.setattr(f"dspark.draft.{'eagle3' if kind == 'eagle3' else 'dspark'}.sample",
                        lambda q, u: torch.tensor([next(forced)]))
    full = whole.propose([committed_request(whole, 0, feats, seq[a], params)])
    want = full.q * ~outside
    torch.testing.assert_close(got.q, want / want.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


def test_cut_drafter_is_greedy_equal_to_plain_and_cannot_be_saved(tiny_target, tiny_target_dir, tmp_path):
    model = tiny_drafter(tiny_target, "vanilla", seed=5)
    save_drafter(model, tmp_path)
    data = write_train_data(tmp_path / "train.jsonl", [(4, 60)] * 6)
    assert main(["draft-vocab", "--drafter", str(tmp_path), "--data", str(data), "--size", "96"]) == 0
    vocab = json.loads((tmp_path / DRAFT_VOCAB_FILE).read_text())
    assert vocab["size"] == 96 and 1 in vocab["ids"] and 0 < vocab["coverage"] < 1  # the eos id and 95 others
    llm = LLM(str(tiny_target_dir), drafter=str(tmp_path), dtype="fp32")
    assert len(llm.engine.drafter.model.draft_ids) == 96
    plain = llm.sibling("none")
    prompts = [[5 + i, 40, 41, 42] * 3 for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert sum(s.verify_tokens - s.num_requests for s in llm.engine.stats) > 0  # drafts were verified
    q4 = LLM(str(tiny_target_dir), drafter=str(tmp_path), dtype="q4_1")  # its head cut, then in 4 bits
    assert q4.engine.drafter.model.lm_head.out_features == 96
    assert len(q4.generate([prompts[0]], greedy, use_tqdm=False)[0].token_ids) == 40
    with pytest.raises(ValueError, match="draft vocabulary"):
        save_drafter(llm.engine.drafter.model, tmp_path / "again")
