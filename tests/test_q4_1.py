"""The q4_1 weights: quantizing weights that are already on a Q4_1 grid finds that grid again (so the bundled
GGUF target keeps its own weights), the packed kernel computes x·Wᵀ for the dequantized W, and a q4_1 engine
runs the whole data path."""
import pytest
import torch
from tiny_models import one_thread, tiny_target_dir  # noqa: F401

from dspark import LLM, SamplingParams
from dspark.target.loading import load_target
from test_target_parity import CachedRunner

from dspark.kernels.q4_1 import GROUP, Q4Linear, dequantize_q4_1, quantize_q4_1


def on_grid(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random Q4_1 weight as a GGUF holds it: q in 0..15 with 0 and 15 in every group, float16 d and m."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's rule puts the group's min at 0 and its max at 15
    d = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.1).half().float()
    return q.view(n, k).int(), d, m


def test_requantizing_a_q4_1_weight_finds_the_same_grid():
    q, d, m = on_grid(64, 128)
    q2, d2, m2 = quantize_q4_1(dequantize_q4_1(q, d, m))
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)


def test_quantization_error_of_arbitrary_weights_is_within_half_a_step():
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    q, d, m = quantize_q4_1(w)
    assert q.min() >= 0 and q.max() <= 15
    step = d.repeat_interleave(GROUP, 1)
    assert ((dequantize_q4_1(q, d, m) - w).abs() <= 0.5 * step + 1e-3).all()


@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_equals_the_dequantized_product(bias, one_thread):  # noqa: F811
    q, d, m = on_grid(96, 64, seed=2)
    linear = torch.nn.Linear(64, 96, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(dequantize_q4_1(q, d, m))
    x = torch.randn(5, 3, 64)
    ours = Q4Linear(linear)(x.bfloat16()).float()
    reference = linear(x.bfloat16().float())
    assert ours.shape == (5, 3, 96)
    # bf16 activations, scales and output: relative error of a few bf16 ulps
    assert (ours - reference).abs().max() <= 2e-2 * reference.abs().max()


def test_q4_1_target_replaces_every_layer_projection(tiny_target_dir):  # noqa: F811
    model = load_target(str(tiny_target_dir), torch.bfloat16, q4_1=True)[0]
    kinds = {type(m).__name__ for layer in model.layers for m in layer.modules() if hasattr(m, "in_features")}
    assert kinds == {"Q4Linear"}
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16


def test_q4_1_smollm_keeps_the_gguf_weights(smollm_fp32, chat_ids):
    """The bundled target in q4_1 computes the float32 target's logits up to bf16 rounding (its layers are
    exactly the GGUF's Q4_1 weights), as close as the plain bf16 target does."""
    fp32 = smollm_fp32[0]
    q4 = load_target(None, torch.bfloat16, q4_1=True)[0]
    worst = 0.0
    for name, module in fp32.layers.named_modules():
        if isinstance(module, torch.nn.Linear):  # the grid found again, weight for weight
            q, d, m = quantize_q4_1(module.weight)
            worst = max(worst, float((dequantize_q4_1(q, d, m) - module.weight).abs().max()))
    assert worst == 0.0
    bf16 = load_target(None, torch.bfloat16)[0]
    ids = chat_ids[0][:48]
    ref, ours, plain = (CachedRunner(m, 1).forward([ids])[0] for m in (fp32, q4, bf16))
    err, bf16_err = (float((x - ref).abs().max() / ref.abs().max()) for x in (ours, plain))
    print(f"max logit error relative to float32: q4_1 {err:.4f}, bf16 {bf16_err:.4f}")
    assert err < 1.5 * bf16_err
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_q4_1_engine_generates_with_drafts(tiny_target_dir, one_thread):  # noqa: F811
    """The whole data path in q4_1 on the tiny target: plain and prompt-lookup decoding, ragged batch."""
    q4 = LLM(str(tiny_target_dir), drafter="prompt-lookup", dtype="q4_1", max_num_seqs=4)
    assert isinstance(q4.engine.target.layers[0].mlp.down_proj, Q4Linear)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [7, 7, 7], [300, 301]]
    outputs = q4.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [12, 12, 12]
