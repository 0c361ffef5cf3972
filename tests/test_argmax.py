"""argmax.cpp picks what torch.argmax picks: each row's first largest value, a NaN counting as the largest, in
bf16 and float32, on this CPU's instructions and the older sets it runs (AVX2, AVX-512), rows whose length is no
multiple of the vector width included."""
import pytest
import torch

from dspark.kernels.argmax import argmax_rows
from test_skinny import MARCHES, built


def cases(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(rows, n, generator=g).to(dtype) for rows, n in ((1, 49152), (8, 8192), (5, 37), (3, 1))]
    ties = torch.randint(-3, 4, (16, 100), generator=g).to(dtype)  # many equal largest values: the first wins
    special = torch.randn(6, 70, generator=g).to(dtype)
    special[0, 40], special[0, 65] = float("nan"), float("nan")  # the first NaN
    special[1, 66] = float("nan")  # a NaN in the tail past the last whole vector
    special[2] = float("-inf")
    special[3, 10], special[3, 50] = float("inf"), float("inf")
    special[4, 69] = 1e4  # the largest in the tail
    return out + [ties, special]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_is_torch_argmax(dtype, march):
    lib = built(march)
    for x in cases(dtype):
        assert torch.equal(argmax_rows(x, lib), x.argmax(-1)), x.shape
