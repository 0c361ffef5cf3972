"""The numerics contract (Options.exact, the default): every row of every forward of the target gives the
bit-identical logits that the same token gives when decoded alone, whatever the forward's width (verify chains of
2, 7, 16 and 32 tokens), whether it is a prefill, which other requests share the forward, or where a draft tree puts
it; in bf16, float32 and q4_1, on each kernel path this machine can run (the compiled kernels for this CPU and for
the older instruction sets it also runs, the layer loop, PyTorch's kernels alone), with 1 or 2 threads.

The check has power: with a path made to round differently (forwards of 7 rows or more through upcast.py's float32
products, as without the contract on CPUs without a bf16 unit) it finds differing rows.
"""
from __future__ import annotations

import pytest
import torch

import dspark.kernels.upcast as upcast
from dspark import SamplingParams
from dspark.target.kv_cache import KVCache
from dspark.target.model import FlatBatch
from test_skinny import cpu_has, needs_kernel

WIDTHS = (2, 7, 16, 32)
CONTINUATION = 33  # tokens after the prompt whose logits are compared (a 32-token forward among them)

# kernel paths: (Options changes, marks)
PATHS = {
    "native": ({}, [needs_kernel]),
    "avx2": ({"kernels": "haswell"}, [pytest.mark.skipif(not cpu_has("avx2", "fma"), reason="no AVX2")]),
    "avx512": ({"kernels": "skylake-avx512"}, [pytest.mark.skipif(
        not cpu_has("avx512f", "avx512bw", "avx512dq", "avx512vl"), reason="no AVX-512")]),
    "avx512-bf16": ({"kernels": "cooperlake"}, [pytest.mark.skipif(
        not cpu_has("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"), reason="no AVX-512 BF16")]),
    "layer-loop": ({"fused": False}, [needs_kernel]),
    "pytorch": ({"kernels": "pytorch"}, []),
}


def path_params():
    return [pytest.param(changes, id=name, marks=marks) for name, (changes, marks) in PATHS.items()]


class Rows:
    """Logits of a fixed token sequence (a prompt and its greedy continuation) computed in different forwards."""

    def __init__(self, llm, prompt: str):
        self.target = llm.engine.target
        self.prompt = llm.chat_prompt(prompt)
        greedy = SamplingParams(temperature=0, max_tokens=CONTINUATION, ignore_eos=True)
        self.seq = self.prompt + llm.generate(self.prompt, greedy)[0].token_ids

    def cache(self) -> KVCache:
        c = self.target.config
        cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                        self.target.dtype, 1024, slots=2, capacity=len(self.seq) + 40)
        cache.reserve(2, len(self.seq) + 40)
        return cache

    def forward(self, cache, tokens, positions, query_lens, **fields) -> torch.Tensor:
        out = self.target(FlatBatch(torch.tensor(tokens), torch.tensor(positions), query_lens, **fields), cache)
        return self.target.logits(out.hidden, None)

    def chain(self, width: int) -> torch.Tensor:
        """The prompt prefilled, then the continuation in forwards of `width` tokens: the logits after the prompt's
        last token and after every continuation token."""
        cache, P = self.cache(), len(self.prompt)
        rows = [self.forward(cache, self.prompt, range(P), [P], prefill=True)[-1:]]
        for i in range(P, len(self.seq), width):
            j = min(i + width, len(self.seq))
            rows.append(self.forward(cache, self.seq[i:j], range(i, j), [j - i]))
        return torch.cat(rows)

    def prefilled(self) -> torch.Tensor:
        """The whole sequence as one prefill."""
        P = len(self.prompt)
        return self.forward(self.cache(), self.seq, range(len(self.seq)), [len(self.seq)], prefill=True)[P - 1:]

    def beside(self, other: list[int]) -> torch.Tensor:
        """The continuation in forwards of 7 tokens that share each forward with another request's prefill and then
        its 3-token steps (request 1 in slot 1)."""
        cache, P = self.cache(), len(self.prompt)
        rows = [self.forward(cache, self.prompt + other, list(range(P)) + list(range(len(other))),
                             [P, len(other)], prefill=True)[P - 1:P]]
        at = len(other)
        for i in range(P, len(self.seq), 7):
            j = min(i + 7, len(self.seq))
            filler = [other[(at + k) % len(other)] for k in range(3)]
            logits = self.forward(cache, self.seq[i:j] + filler, list(range(i, j)) + list(range(at, at + 3)),
                                  [j - i, 3])
            rows.append(logits[:j - i])
            at += 3
        return torch.cat(rows)

    def tree(self, at: int) -> torch.Tensor:
        """Continuation tokens at .. at + 3 verified as one branch of a draft tree whose other branch (3 other
        tokens) comes first, so their cache positions and keys interleave: their logits."""
        cache = self.cache()
        self.forward(cache, self.seq[:at], range(at), [at], prefill=True)
        branch, decoy = self.seq[at:at + 4], [17, 29, 31]
        tokens = [branch[0]] + decoy + branch[1:]  # node 0 the root; 1-3 a decoy chain under it; 4-6 the branch
        parents = [-1, 0, 1, 2, 0, 4, 5]
        depth = [0, 1, 2, 3, 1, 2, 3]
        hidden = []
        for i in range(len(tokens)):
            ancestors, p = set(), parents[i]
            while p >= 0:
                ancestors.add(p)
                p = parents[p]
            hidden.append(sum(1 << (i - j) for j in range(i) if j not in ancestors))
        logits = self.forward(cache, tokens, range(at, at + len(tokens)), [len(tokens)],
                              hidden=torch.tensor(hidden), rotary_positions=torch.tensor([at + d for d in depth]))
        return logits[[0, 4, 5, 6]]


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows of a and b that are not bit-identical."""
    assert a.shape == b.shape
    return int((a != b).any(-1).sum())


@pytest.fixture(scope="module")
def q4_llm():
    from dspark import LLM

    return LLM(dtype="q4_1", max_num_seqs=2)


def llm_of(dtype, request):
    if dtype == "q4_1":
        return request.getfixturevalue("q4_llm")
    return request.getfixturevalue("llm_bf16" if dtype == "bf16" else "base_llm_fp32")


@pytest.mark.slow
@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "q4_1"])
def test_every_row_rounds_as_the_token_decoded_alone(dtype, path, chat_prompts, use_options, request):
    if dtype == "q4_1" and path.get("kernels") not in (None, "pytorch") or dtype == "q4_1" and "fused" in path:
        pytest.skip("q4_1 layers run PyTorch's int4 kernel on every path: the native and pytorch cases cover it")
    use_options(**path)
    rows = Rows(llm_of(dtype, request), chat_prompts[1])
    alone = rows.chain(1)
    for width in WIDTHS:
        assert differing(rows.chain(width), alone) == 0, f"width {width}"
    assert differing(rows.prefilled(), alone) == 0, "prefill"
    assert differing(rows.beside(rows.prompt[:12]), alone) == 0, "beside another request"
    P, late = len(rows.prompt), len(rows.seq) - 5
    assert differing(rows.tree(P + 5), alone[6:10]) == 0, "draft tree"
    assert late > 63  # past the keys a tree's bits can hide: those before stay in place, the rest are gathered
    assert differing(rows.tree(late), alone[late - P + 1:late - P + 5]) == 0, "draft tree after 63 keys"


@needs_kernel
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rows_do_not_depend_on_the_thread_count(dtype, chat_prompts, request):
    rows = Rows(llm_of(dtype, request), chat_prompts[0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rows.chain(1)
        torch.set_num_threads(2)
        two = rows.chain(7)
    finally:
        torch.set_num_threads(threads)
    assert differing(one, two) == 0


@needs_kernel
def test_the_check_finds_a_path_that_rounds_differently(chat_prompts, llm_bf16, use_options, monkeypatch):
    """Without the contract, and with forwards of 7 rows or more on upcast.py's float32 products (as on CPUs without a
    bf16 unit), wider forwards round otherwise than one-token decoding: the same checks see it."""
    use_options(exact=False, fused=False)
    monkeypatch.setattr(upcast, "UPCAST_HELPS", True)
    rows = Rows(llm_bf16, chat_prompts[2])
    alone = rows.chain(1)
    assert differing(rows.chain(7), alone) > 0 and differing(rows.prefilled(), alone) > 0
