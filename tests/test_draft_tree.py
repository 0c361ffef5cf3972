"""Draft trees (draft/tree.py): candidates merge into a tree whose first candidate is a chain; each row's hidden
keys and depth; a tree forward gives every row what a chain of its ancestors gives (float32 and bf16, model.py's
loop and fused_layers.cpp, AMX's tiles where the CPU has them, beside a chain request); greedy verification walks
the argmax child and agrees with greedy_verdict on chains; the KV cache keeps the walk's rows; the engine with
lookup trees decodes exactly what plain greedy decoding does, and verifies trees only for greedy steps."""
from __future__ import annotations

import copy

import pytest
import torch

import dspark.kernels.fused_layers as fused_layers
from dspark import SamplingParams
from dspark.draft.lookup_first import LookupFirstDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.draft.tree import chain, layout, merge
from dspark.verify import tree_verdict
from dspark.engine.request import Request
from dspark.target.kv_cache import KVCache
from dspark.target.model import FlatBatch
from dspark.verify import greedy_verdict
from test_fused_layers import random_target
from test_skinny import needs_tiles

CANDIDATES = [[5, 6, 7, 8], [5, 6, 9, 10, 11], [12, 13], [5, 14]]


def test_candidates_merge_into_a_tree_first_candidate_first():
    tokens, parents = merge(CANDIDATES, 14)
    assert tokens == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert parents == [-1, 0, 1, 2, 1, 4, 5, -1, 7, 0]  # 5 6 shared; 9 hangs on 6, 12 on the root, 14 on 5
    assert merge(CANDIDATES, 6) == ([5, 6, 7, 8, 9, 10], [-1, 0, 1, 2, 1, 4])  # cut at 6 nodes
    assert merge([[1, 2, 3]], 14) == ([1, 2, 3], chain(3))


def test_rows_hide_what_is_not_their_ancestor_and_sit_at_their_depth():
    depth, hidden = layout(merge(CANDIDATES, 14)[1])
    assert depth == [0, 1, 2, 3, 4, 3, 4, 5, 1, 2, 2]
    # row 5 (token 9, under row 2): rows 3 and 4 hidden, bits 2 and 1; row 10 (token 14, under row 1): rows 2-9
    assert hidden[5] == 0b110 and hidden[10] == sum(1 << j for j in range(1, 9))
    assert hidden[:5] == [0] * 5
    assert layout(chain(5)) == (list(range(6)), [0] * 6)
    with pytest.raises(ValueError):
        layout([-1, 2])  # a parent after its child


def tree_and_chains(model, tokens: list[int], parents: list[int]):
    """Row by row: the tree forward's hidden state and that of a chain forward of the row's ancestors (request 0),
    beside a request of 3 chain tokens; after prompts of 11 and 6 tokens."""
    c = model.config
    cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, model.layers[0].self_attn.head_dim, model.dtype, 256,
                    2, 64)
    g = torch.Generator().manual_seed(3)
    prompts = [11, 6]
    model(FlatBatch(torch.randint(3, c.vocab_size, (17,), generator=g), torch.cat([torch.arange(p) for p in prompts]),
                    prompts, prefill=True), cache)
    last, beside = 4, [7, 8, 9]
    depth, hidden = layout(parents)
    n = len(tokens) + 1
    tree = model(FlatBatch(torch.tensor([last] + tokens + beside), torch.cat([torch.arange(11, 11 + n), torch.arange(6, 9)]),
                           [n, 3], hidden=torch.tensor(hidden + [0] * 3),
                           rotary_positions=torch.cat([torch.tensor(depth) + 11, torch.arange(6, 9)])), cache).hidden
    chains = []
    for row in range(n):
        path = [row]
        while path[-1] > 0:
            path.append(parents[path[-1] - 1] + 1)
        seq = [last] + [tokens[r - 1] for r in reversed(path[:-1])]
        out = model(FlatBatch(torch.tensor(seq + beside), torch.cat([torch.arange(11, 11 + len(seq)), torch.arange(6, 9)]),
                              [len(seq), 3]), cache).hidden
        chains.append(out[len(seq) - 1])
    return tree[:n].float(), torch.stack(chains).float()


@pytest.mark.parametrize("fused", ["0", "1"])
def test_a_tree_row_is_the_chain_of_its_ancestors(fused, monkeypatch, use_options):
    """float32, model.py's loop and fused_layers.cpp: within 1e-5 of the largest value (measured 4-5e-7; ignoring
    `hidden` in either, 0.98)."""
    use_options(fused=fused == "1")
    calls = []
    real = fused_layers.fused_forward
    monkeypatch.setattr("dspark.target.model.fused_forward", lambda *a: calls.append(1) or real(*a))
    tokens, parents = merge(CANDIDATES, 14)
    tree, chains = tree_and_chains(random_target("qwen3", torch.float32), tokens, parents)
    assert bool(calls) == (fused == "1")
    assert (tree - chains).abs().max() <= 1e-5 * chains.abs().max()


@pytest.mark.parametrize("tiles", [pytest.param("1", marks=needs_tiles), "0"])
def test_a_bf16_tree_row_errs_as_the_chain(tiles, use_options):
    """bf16, fused (attention on AMX's tiles for runs of 2+ tokens where the CPU has them): against the float32
    chains, the tree rows' mean error is at most 1.2x the bf16 chains' (measured 0.99; ignoring `hidden`: 26x)."""
    use_options(tiles=tiles == "1")
    tokens, parents = merge(CANDIDATES, 14)
    model = random_target("qwen3", torch.bfloat16)
    _, exact = tree_and_chains(copy.deepcopy(model).float(), tokens, parents)
    tree, chains = tree_and_chains(model, tokens, parents)
    assert (tree - exact).abs().mean() <= 1.2 * (chains - exact).abs().mean()


def test_greedy_walks_the_argmax_child_and_equals_greedy_verdict_on_chains():
    tokens, parents = merge(CANDIDATES, 14)
    T = len(tokens) + 1
    best = torch.full((T + 2,), 99)  # request 0: the tree; request 1: a chain of 1 draft after it
    best[0], best[1 + 1], best[1 + 4] = 5, 9, 3  # root -> 5 (draft 0); after 5 6 (row 2) -> 9 (draft 4); then 3
    best[1] = 6
    verdict = tree_verdict(best, torch.tensor([0, T]), torch.tensor([tokens, [99] + [0] * (len(tokens) - 1)]),
                           torch.tensor([parents, chain(len(tokens))]), torch.tensor([len(tokens), 1]))
    assert verdict.path == [[0, 1, 4], [0]] and verdict.num_accepted.tolist() == [3, 1]
    assert verdict.next_token.tolist() == [3, 99]
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        R, G = 3, 5
        lengths = torch.randint(0, G + 1, (R,), generator=g)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), (lengths + 1).cumsum(0)[:-1]])
        best = torch.randint(0, 3, (int((lengths + 1).sum()),), generator=g)
        drafts = torch.randint(0, 3, (R, G), generator=g)
        a = greedy_verdict(best, starts, drafts, lengths)
        b = tree_verdict(best, starts, drafts, torch.tensor([chain(G)] * R), lengths)
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)


def test_the_cache_keeps_the_walk():
    cache = KVCache(2, 1, 4, torch.float32, 64, 2, 16)
    cache.k[:, 1, :, :10] = torch.arange(10.0)[None, None, :, None]
    cache.keep(1, 3, [0, 2, 5])  # rows 0, 2, 5 after position 3 -> positions 3, 4, 5
    assert cache.k[0, 1, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 8]
    assert cache.k[1, 0].abs().sum() == 0  # other slots untouched


def test_lookup_trees_decode_as_plain_greedy(make_llm, greedy, chat_ids, solo_greedy):
    llm = make_llm("lookup+default", max_num_seqs=4)
    engine = llm.engine
    walks = []  # per request and step: the accepted drafts of a tree
    accept = engine._accept

    def spy(reqs, logits, batch, proposal, lengths, greedy_step):
        verdict = accept(reqs, logits, batch, proposal, lengths, greedy_step)
        walks.extend(verdict.path or [])
        return verdict

    engine._accept = spy
    outs = llm.generate(chat_ids, greedy)
    assert [o.token_ids for o in outs] == solo_greedy
    assert any(path and path != list(range(len(path))) for path in walks)  # walks off the first chain happened


def test_trees_only_for_greedy_steps():
    drafter = LookupFirstDrafter(PromptLookupDrafter(8), [PromptLookupDrafter(6, 3, 2), PromptLookupDrafter(4, 1, 1)])
    ids = [7, 1, 2, 3, 9, 2, 5, 1, 2]  # "1 2" came before 3 9 2 5 1 2; "2" last came before 5 1 2 (5 1 2 5 ...)
    greedy = drafter.propose([Request(ids, SamplingParams(temperature=0))])
    assert greedy.tokens[0].tolist() == [3, 9, 2, 5, 1, 2, 5, 1] and greedy.lengths.tolist() == [8]  # 8 nodes at most
    assert greedy.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, -1, 6]
    sampled = drafter.propose([Request(ids, SamplingParams(temperature=0)), Request(ids, SamplingParams(temperature=1))])
    assert sampled.parents is None and sampled.lengths.tolist() == [6, 6]
    assert LookupFirstDrafter(PromptLookupDrafter(4), drafter.sources, tree=False).propose(
        [Request(ids, SamplingParams(temperature=0))]).parents is None
