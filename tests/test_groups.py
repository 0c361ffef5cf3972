"""groups.py: float32 weights on a GGUF grid are held as Q4_1 or Q8_0 groups only when those give back every
value bit for bit; their few-row products are bit-identical to skinny.cpp's dense float32 product (every
instruction set it builds for); the bundled target holds all its layers and its LM head so, and its forwards are
unchanged by it (the logits of decode and verify forwards equal those without groups)."""
import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.groups import Groups
from dspark.layers import Linear
from dspark.kernels.q4_1 import GROUP, dequantize_q4_1
from dspark.kernels.skinny import MAX_ROWS, skinny_linear
from test_q4_1 import on_grid
from test_skinny import MARCHES, built, needs_kernel
from test_target_parity import CachedRunner

pytestmark = needs_kernel


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return dequantize_q4_1(*on_grid(n, k, seed))


def q8_0_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random Q8_0 weight as a GGUF holds it: q in -127..127 with ±127 in every group, float16 d."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0] = 127 * (torch.randint(0, 2, (n, k // GROUP), generator=g) * 2 - 1)
    d = (torch.rand(n, k // GROUP, generator=g) * 1e-3 + 1e-4).half().float()
    return (q * d[..., None]).view(n, k)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind,make", [("q4_1", q4_1_weight), ("q8_0", q8_0_weight)])
def test_group_products_are_bit_identical_to_the_dense_product(kind, make, march):
    lib = built(march)
    g = torch.Generator().manual_seed(2)
    for n, k in [(49, 576), (130, 1536), (1, 32)]:
        weight, bias = make(n, k), torch.randn(n, generator=g)
        groups = Groups.of(weight, lib)
        assert groups is not None and groups.kind == kind
        assert groups.nbytes() < weight.numel() * 4 * (0.3 if kind == "q8_0" else 0.2)
        for rows in range(1, MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=g)
            for b in (None, bias):
                out = groups(x, b, lib)
                assert torch.equal(out, skinny_linear(x, weight, b, lib)), (n, k, rows, b is None)
                assert torch.allclose(out, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_weights_off_the_grid_are_not_held():
    assert Groups.of(torch.randn(8, 64)) is None
    assert Groups.of(q4_1_weight(8, 64)[:, :48].contiguous()) is None  # input width not a multiple of 32
    assert Groups.of(q4_1_weight(8, 64).bfloat16()) is None  # float32 only
    for weight in (q4_1_weight(8, 64), q8_0_weight(8, 64)):
        nudged = weight.clone()
        nudged[5, 37] = torch.nextafter(nudged[5, 37], torch.tensor(1.0))  # one value one ulp off its grid
        assert Groups.of(weight) is not None and Groups.of(nudged) is None


def test_the_bundled_target_holds_groups_and_its_forwards_are_unchanged(smollm_fp32, chat_ids):
    model, _, _ = smollm_fp32
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.groups is not None for m in linears) and len(linears) == 4 * len(model.layers) + 1
    assert model.lm_head.groups.kind == "q8_0" and {m.groups.kind for m in model.layers.modules()
                                                     if isinstance(m, Linear)} == {"q4_1"}
    ids = chat_ids[0]

    def forwards():  # a prefill, a decode and a verify of 7 tokens
        runner = CachedRunner(model, 1)
        return [runner.forward([chunk])[0] for chunk in (ids[:-8], ids[-8:-7], ids[-7:])]

    with_groups = forwards()
    held = {m: m.groups for m in linears}
    try:
        for m in linears:
            m.groups = None
        dense = forwards()
    finally:
        for m, groups in held.items():
            m.groups = groups
    for a, b in zip(with_groups, dense):
        assert torch.equal(a, b)


def test_a_drafters_head_reads_nearest_q8_0_groups_for_few_rows_only(llm_bf16):
    """A drafter's LM head (any dtype, any grid) in the nearest Q8_0 groups: inference products of up to HEAD_ROWS
    rows read them (close to the dense product, not equal: the drafter's q is whatever it samples from), more
    rows and autograd keep the dense weight; the bundled drafter's head gets them at load."""
    from dspark.draft import make_drafter
    from dspark.kernels.groups import HEAD_ROWS, hold_head_groups
    from dspark.kernels.upcast import ManyRowsLinear

    head = ManyRowsLinear(64, 300, bias=False).to(torch.bfloat16).requires_grad_(False)
    assert hold_head_groups(head) and head.groups.kind == "q8_0"
    x = torch.randn(HEAD_ROWS + 1, 64).to(torch.bfloat16)
    dense = F.linear(x.float(), head.weight.float())
    with torch.inference_mode():
        few = head(x[:HEAD_ROWS])
        assert torch.equal(few, head.groups(x[:HEAD_ROWS].float()).to(torch.bfloat16))
        assert not torch.equal(few, F.linear(x[:HEAD_ROWS], head.weight))  # the groups, not the dense weight
        assert torch.allclose(few.float(), dense[:HEAD_ROWS], rtol=0.05, atol=0.05 * dense.abs().max())
        assert torch.equal(head(x), F.linear(x, head.weight))  # more rows: the dense product
    assert torch.equal(head(x[:1]), F.linear(x[:1], head.weight))  # autograd on: dense
    drafter = make_drafter("default", 7, llm_bf16.engine.target, 512)
    assert drafter.model.lm_head.groups is not None and drafter.model.lm_head.groups.kind == "q8_0"
