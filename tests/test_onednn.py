"""onednn.linear: F.linear's result, rows independent of the other rows of a product, autograd and bf16 on F.linear."""
import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.onednn import ONEDNN, linear

pytestmark = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")


def weights(n=960, k=576, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, k, generator=g).to(dtype) * 0.02, torch.randn(64, k, generator=g).to(dtype)


@torch.inference_mode()
def test_matches_f_linear_with_and_without_bias():
    w, x = weights()
    b = torch.randn(w.shape[0])
    for rows in (1, 2, 3, 7, 64):
        torch.testing.assert_close(linear(x[:rows], w), F.linear(x[:rows], w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x[:rows], w, b), F.linear(x[:rows], w, b), rtol=1e-5, atol=1e-5)
    assert linear(x[None, :6], w).shape == (1, 6, w.shape[0])  # leading dims kept
    assert linear(x[:, ::2], w[:, ::2]).shape == (64, w.shape[0])  # strided operands


@torch.inference_mode()
def test_rows_do_not_depend_on_the_rest_of_the_product():
    """Batch invariance from two rows up: a request's logits must not depend on who shares the forward
    (PyTorch's default float32 kernel fails this for 2 and 3 rows on AVX2 CPUs)."""
    w, x = weights()
    full = linear(x, w)
    for rows in (2, 3, 4, 5, 8, 16, 33):
        assert torch.equal(linear(x[:rows], w), full[:rows]), rows


def test_autograd_and_bf16_take_f_linear():
    w, x = weights()
    x = x[:3].clone().requires_grad_(True)
    linear(x, w).sum().backward()  # oneDNN's op has no backward: this would raise on it
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, -1))
    wb, xb = weights(dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear(xb[:3], wb), F.linear(xb[:3], wb))
