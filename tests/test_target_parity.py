"""Our flat-batch forward with a KV cache computes the same logits as transformers' own forward on the same
weights (float32): the bundled SmolLM2, tiny random Llama and Qwen3 models, ragged batches of requests
with different cached and query lengths, and after rolling back rejected positions."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

from dspark.sampling import warp
from dspark.target.kv_cache import KVCache
from dspark.target.loading import load_target
from dspark.target.model import FlatBatch
from dspark.verify import rejection_sample

PARITY_TOL = 1e-4  # max |ours - transformers| / max |transformers logit|
ROLLBACK_TOL = 1e-5  # same forward code on both sides: only summation order differs


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


class CachedRunner:
    """Feeds chunks of several token sequences through a TargetModel, one KV-cache slot per sequence."""

    def __init__(self, model, num_seqs: int, max_len: int = 1024):
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.model = model
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, head_dim, model.dtype, max_len)
        for _ in range(num_seqs):
            self.cache.allocate()
        self.lengths = [0] * num_seqs  # cached positions per slot

    def forward(self, chunks: list[list[int]], first_slot: int = 0) -> list[torch.Tensor]:
        """Append chunks[i] to the sequence in slot first_slot + i; returns each chunk's logits [n_i, V]."""
        lens = [len(c) for c in chunks]
        starts = self.lengths[first_slot:first_slot + len(chunks)]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        self.cache.reserve(len(self.lengths), int(positions.max()) + 1)
        batch = FlatBatch(torch.tensor([t for c in chunks for t in c]), positions, lens, slot_start=first_slot)
        logits = self.model.logits(self.model(batch, self.cache).hidden)
        for i, n in enumerate(lens):
            self.lengths[first_slot + i] += n
        return list(logits.split(lens))

    def rollback(self, slot: int, length: int):
        """Keep only the first `length` cached positions of a slot."""
        self.lengths[slot] = length


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


# ---- the bundled SmolLM2 -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_hf(smollm_fp32):
    _, _, folder = smollm_fp32
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_smollm_prefill_then_continue_matches_transformers(smollm_fp32, smollm_hf, chat_ids):
    model, _, _ = smollm_fp32
    ids = chat_ids[0]
    split = len(ids) - 12  # prefill (> 16 tokens: the fused attention), then 12 tokens over the cache
    assert split > 16
    runner = CachedRunner(model, 1)
    first, = runner.forward([ids[:split]])
    rest, = runner.forward([ids[split:]])
    ref = hf_logits(smollm_hf, ids)
    assert rel_err(first, ref[:split]) < PARITY_TOL
    assert rel_err(rest, ref[split:]) < PARITY_TOL


def test_smollm_ragged_batch_matches_transformers(smollm_fp32, smollm_hf, chat_ids):
    model, _, _ = smollm_fp32
    runner = CachedRunner(model, 3)
    seqs = chat_ids[1:4]
    cut1 = [30, 5, 17]
    cut2 = [c + n for c, n in zip(cut1, [3, 9, 1])]
    first = runner.forward([s[:c] for s, c in zip(seqs, cut1)])
    second = runner.forward([s[a:b] for s, a, b in zip(seqs, cut1, cut2)])
    for s, c1, c2, a, b in zip(seqs, cut1, cut2, first, second):
        ref = hf_logits(smollm_hf, s[:c2])
        assert rel_err(a, ref[:c1]) < PARITY_TOL
        assert rel_err(b, ref[c1:c2]) < PARITY_TOL


# ---- tiny random Llama and Qwen3 targets, saved and loaded like real ones ----------------------
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152,  # the SmolLM2 tokenizer's, saved with the weights
            max_position_embeddings=512, initializer_range=0.2)  # large weights: sharp attention patterns
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen3": lambda: Qwen3Config(**TINY, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False,
                                 rope_theta=1000.0),
}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_pair(request, smollm_fp32, tmp_path_factory):
    """(our TargetModel loaded from a saved folder, the transformers model it was saved from)."""
    _, _, smollm_folder = smollm_fp32
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(TINY_CONFIGS[request.param]()).float().eval()
    with torch.no_grad():  # norm weights start at one; make them differ so that swapped ones show
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm_folder).save_pretrained(folder)
    model, tokenizer, loaded_from = load_target(str(folder), torch.float32)
    assert loaded_from == folder and len(tokenizer) == hf.config.vocab_size
    return model, hf


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tiny_prefill_then_continue_matches_transformers(tiny_pair):
    model, hf = tiny_pair
    ids = random_ids(40, seed=1)
    runner = CachedRunner(model, 1)
    first, = runner.forward([ids[:29]])
    few, = runner.forward([ids[29:34]])  # few rows: skinny.py's kernel where it is built
    rest, = runner.forward([ids[34:]])
    ref = hf_logits(hf, ids)
    assert rel_err(first, ref[:29]) < PARITY_TOL
    assert rel_err(few, ref[29:34]) < PARITY_TOL
    assert rel_err(rest, ref[34:]) < PARITY_TOL


def test_tiny_ragged_batches_match_transformers(tiny_pair):
    """Three requests: a ragged prefill (one long query), a ragged verify-sized forward over all of
    them, then a forward over slots 1..2 only (slot 0 longer and idle), as the engine's admissions do."""
    model, hf = tiny_pair
    seqs = [random_ids(60, seed=s) for s in (2, 3, 4)]
    plan = [([25, 3, 9], 0), ([2, 7, 1], 0), ([5, 16], 1)]  # (query length per request, first slot)
    runner = CachedRunner(model, 3)
    done = [0, 0, 0]
    for lens, first_slot in plan:
        slots = range(first_slot, first_slot + len(lens))
        outs = runner.forward([seqs[s][done[s]:done[s] + n] for s, n in zip(slots, lens)], first_slot)
        for s, n, out in zip(slots, lens, outs):
            ref = hf_logits(hf, seqs[s][:done[s] + n])[done[s]:]
            assert rel_err(out, ref) < PARITY_TOL, (lens, s)
            done[s] += n


# ---- rollback -----------------------------------------------------------------------------------
def greedy_next(model, ids: list[int]) -> int:
    return int(CachedRunner(model, 1).forward([ids])[0][-1].argmax())


def test_rollback_after_rejection_matches_fresh_forward(smollm_fp32, chat_ids):
    """Verify four drafts (two right, then a wrong one), keep the accepted prefix, feed the correction
    token: its logits equal those of a fresh cache over the committed tokens. A longer request shares
    the batch, so the stale (rolled back) cache entries lie inside the attended key range."""
    model, _, _ = smollm_fp32
    short, long = chat_ids[0][:20], chat_ids[2]
    right = [greedy_next(model, short)]
    right.append(greedy_next(model, short + right))
    correct_third = greedy_next(model, short + right)
    drafts = right + [(correct_third + 1) % model.config.vocab_size, right[0]]

    runner = CachedRunner(model, 2)
    runner.forward([short[:-1], long[:40]])  # short[-1] is the newest token, not yet fed
    block = [short[-1]] + drafts
    verify_logits, _ = runner.forward([block, long[40:43]])
    n = len(block)
    p = warp(verify_logits, torch.zeros(n), torch.ones(n), torch.zeros(n, dtype=torch.long))  # greedy
    verdict = rejection_sample(p, torch.tensor([0]), torch.tensor([drafts]), None, torch.tensor([len(drafts)]),
                               torch.rand(1, len(drafts)), torch.rand(1))
    assert int(verdict.num_accepted) == 2 and int(verdict.next_token) == correct_third

    committed = short + right
    runner.rollback(0, len(committed))
    after, _ = runner.forward([[correct_third], long[43:45]])
    ref = CachedRunner(model, 1).forward([committed + [correct_third]])[0][-1:]
    assert rel_err(after, ref) < ROLLBACK_TOL
