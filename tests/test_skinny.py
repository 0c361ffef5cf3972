"""skinny.py's few-row kernel computes the product (bf16 and float32, with tails and bias); a row's result does
not depend on the other rows of the product; the target's decode and verify forwards of at most MAX_ROWS rows
take it (prefills and larger forwards do not); without it (Options.kernels="pytorch") PyTorch's kernels run."""
import pytest
import torch
import torch.nn.functional as F

import dspark.kernels.upcast as upcast
import dspark.kernels.skinny as skinny
from dspark.kernels.skinny import MAX_ROWS, kernel, skinny_linear
from test_upcast import prefill

needs_kernel = pytest.mark.skipif(kernel() is None, reason="skinny.cpp cannot be built on this machine")


def cpu_has(*flags: str) -> bool:
    return set(flags) <= set(skinny.cpu_signature().split())


# the kernel's code paths: this CPU's own instructions (AMX tiles where it has them), and the older sets where
# this CPU runs them
MARCHES = [pytest.param("native", marks=needs_kernel),
           pytest.param("haswell", marks=pytest.mark.skipif(not cpu_has("avx2", "fma"), reason="no AVX2")),
           pytest.param("skylake-avx512", marks=pytest.mark.skipif(
               not cpu_has("avx512f", "avx512bw", "avx512dq", "avx512vl"), reason="no AVX-512")),
           pytest.param("cooperlake", marks=pytest.mark.skipif(  # AVX-512 BF16 without AMX's tiles
               not cpu_has("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"), reason="no AVX-512 BF16"))]


def built(march: str):
    lib = kernel(march)
    if lib is None:
        pytest.skip(f"skinny.cpp cannot be built for {march}")
    return lib

# (N, K): K with and without a tail beyond the vector width, N not a multiple of the tile's rows
SHAPES = [(49, 576), (7, 13), (130, 1536), (1, 40)]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_kernel_computes_the_product(dtype, tol, march):
    lib = built(march)
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight, bias = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        for rows in range(1, MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=g).to(dtype)
            for b in (None, bias):
                out = skinny_linear(x, weight, b, lib)
                exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
                assert out.dtype == dtype and out.shape == (rows, n)
                assert (out.double() - exact).abs().max() <= tol * exact.abs().max(), (n, k, rows, b is None)


needs_tiles = pytest.mark.skipif(not (kernel() is not None and skinny.runs_tiles()), reason="no AMX tiles here")
AMX_MAX_ROWS = 32  # skinny.cpp's: products over packed weights of 1 (2 without Options.exact) to 32 rows run on the tiles


def packed_linear(n: int, k: int, seed: int) -> torch.nn.Linear:
    """A bf16 layer with random weights and bias, its weight packed for AMX's tiles (skinny.tiles)."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(k, n).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        layer.bias.copy_(torch.randn(n, generator=g))
    return layer


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_rows_beside_it(dtype, march):
    lib = built(march)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 1000, generator=g).to(dtype)
    x = torch.randn(MAX_ROWS, 1000, generator=g).to(dtype)
    alone = torch.cat([skinny_linear(x[i:i + 1], weight, None, lib) for i in range(MAX_ROWS)])
    for rows in range(2, MAX_ROWS + 1):
        assert torch.equal(skinny_linear(x[:rows], weight, None, lib), alone[:rows]), rows


@needs_tiles
@pytest.mark.parametrize("exact", [True, False])
def test_packed_weights_give_the_product_and_rows_alone(exact, use_options):
    """Every row of a product over packed weights, of any width (more than AMX_MAX_ROWS: 32 at a time), rounds as
    that row alone; without Options.exact one row runs on vdpbf16ps, as without the copy."""
    use_options(exact=exact)
    g = torch.Generator().manual_seed(2)
    for n, k in ((64, 96), (80, 576), (32, 1536)):  # blocks of 48 and 16 or 32 rows (up to 16 rows of x), 32 and 16 (more)
        layer = packed_linear(n, k, n + k)
        packed = skinny.tiles(layer)
        assert packed is not None and skinny.tiles(layer) is packed  # made once
        x = torch.randn(AMX_MAX_ROWS + 8, k, generator=g).bfloat16()
        for b in (None, layer.bias):
            full = skinny_linear(x, layer.weight, b, packed=packed)
            ref = torch.nn.functional.linear(x.double(), layer.weight.double(), None if b is None else b.double())
            assert (full.double() - ref).abs().max() <= 1e-2 * ref.abs().max(), (n, k)
            for rows in range(1 if exact else 2, AMX_MAX_ROWS + 8):
                if not exact and rows % AMX_MAX_ROWS == 1:
                    continue  # a lone last row of 32: on vdpbf16ps without the contract
                assert torch.equal(skinny_linear(x[:rows], layer.weight, b, packed=packed), full[:rows]), (n, k, rows)
            assert torch.equal(skinny_linear(x[AMX_MAX_ROWS + 3:AMX_MAX_ROWS + 4], layer.weight, b, packed=packed),
                               full[AMX_MAX_ROWS + 3:AMX_MAX_ROWS + 4]) == exact, (n, k)
            if not exact:
                one = skinny_linear(x[:1], layer.weight, b, packed=packed)
                assert torch.equal(one, skinny_linear(x[:1], layer.weight, b)), (n, k)


@needs_tiles
@pytest.mark.parametrize("exact", [True, False])
def test_packed_weights_take_amx_tiles_for_1_or_2_to_32_rows(exact, use_options):
    # a sum whose result shows its order: vdpbf16ps keeps 2^25 and -2^25 in one lane, where they cancel, and the
    # 30 ones in others (30); AMX's tiles add the ones to 2^25 (lost to rounding) before -2^25 arrives
    x = torch.zeros(64)
    x[0], x[2:32], x[32] = 2.0**25, 1.0, -(2.0**25)
    use_options(exact=exact)
    layer = torch.nn.Linear(64, 32, bias=False).bfloat16()  # one whole block of weight rows
    with torch.no_grad():
        layer.weight.fill_(1)
    for rows in range(1, AMX_MAX_ROWS + 1):
        rows_x = x.repeat(rows, 1).bfloat16()
        assert bool((skinny_linear(rows_x, layer.weight) == 30).all()), rows  # in place: vdpbf16ps
        out = skinny_linear(rows_x, layer.weight, packed=skinny.tiles(layer))
        assert bool((out == 30).all()) == (not exact and rows == 1), (rows, out[0, 0].item())


@needs_tiles
def test_tiles_pack_16_by_32_blocks_as_column_pairs():
    layer = packed_linear(64, 96, 3)
    packed = skinny.tiles(layer)
    assert packed.shape == (4, 3, 16, 16, 2)
    w = layer.weight
    for a, c, p, r, i in ((0, 0, 0, 0, 0), (1, 2, 5, 15, 1), (3, 1, 15, 7, 0)):
        assert packed[a, c, p, r, i] == w[16 * a + r, 32 * c + 2 * p + i]
    with torch.no_grad():
        layer.weight.add_(1)  # a changed weight is packed again
    assert torch.equal(skinny.tiles(layer)[1, 2, 5, 15, 1], layer.weight[31, 75])


def test_tiles_only_for_bf16_weights_in_whole_tiles(monkeypatch, use_options):
    assert skinny.tiles(torch.nn.Linear(96, 64)) is None  # float32
    assert skinny.tiles(torch.nn.Linear(40, 64).bfloat16()) is None  # K not a multiple of 32
    assert skinny.tiles(torch.nn.Linear(96, 40).bfloat16()) is None  # N not a multiple of 16
    use_options(tiles=False)
    assert skinny.tiles(torch.nn.Linear(96, 64).bfloat16()) is None  # switched off


@needs_kernel
def test_decode_and_verify_forwards_take_the_kernel(llm_bf16, monkeypatch, use_options):
    """Without Options.exact the layer loop's products of at most MAX_ROWS rows take the kernel (prefills and wider
    forwards PyTorch's); with it every product of the target does."""
    use_options(fused=False, exact=False)  # the layer loop's choice (fused_layers.cpp calls the kernel itself)
    target, calls = llm_bf16.engine.target, []
    real = skinny.skinny_linear
    monkeypatch.setattr(upcast, "skinny_linear", lambda x, w, b: calls.append(len(x)) or real(x, w, b))
    for tokens, is_prefill, expect in ((MAX_ROWS, False, True), (1, False, True), (MAX_ROWS + 1, False, False),
                                       (3, True, False)):
        calls.clear()
        hidden = torch.cat(prefill(target, [list(range(1, tokens + 1))], is_prefill))
        assert bool(calls) == expect and all(n == tokens for n in calls), (tokens, is_prefill, calls)
        calls.clear()
        target.logits(hidden)  # the LM head by its own row count (a prefill's last rows, a verify's rows)
        assert bool(calls) == (tokens <= MAX_ROWS), (tokens, calls)
    use_options(exact=True)
    for tokens, is_prefill in ((MAX_ROWS + 1, False), (3, True), (1, False)):
        calls.clear()
        hidden = torch.cat(prefill(target, [list(range(1, tokens + 1))], is_prefill))
        target.logits(hidden)
        assert len(calls) == 1 + 4 * len(target.layers) and all(n == tokens for n in calls), (tokens, is_prefill)


def test_without_the_kernel_pytorch_runs(llm_bf16, use_options):
    use_options(kernels="pytorch")
    assert kernel() is None
    x, weight = torch.randn(2, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    assert not skinny.takes_skinny(x, weight)
    assert upcast.product_kernel(x, weight) is upcast.linear
    with torch.inference_mode():
        assert upcast.product_kernel(x, weight, exact=True) is upcast.blocked_linear
