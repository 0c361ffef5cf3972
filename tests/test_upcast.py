"""The float32 path for many-row bf16 products computes the product; prefill batch invariance holds (a row's
result, and a request's prefill, do not depend on what else shares the forward); the target's forwards take
the path for a prefill or many rows, never for one row."""
import pytest
import torch
import torch.nn.functional as F

import dspark.kernels.upcast as upcast
from dspark.target.kv_cache import KVCache
from dspark.target.model import FlatBatch
from dspark.kernels.skinny import MAX_ROWS
from dspark.kernels.upcast import CHUNK, upcast_linear

ROW_COUNTS = (1, 2, 3, 4, 5, 9, 17, 44, 130)


def test_upcast_product_rows_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(CHUNK + 300, 576, generator=g) * 0.05).bfloat16()  # more than one chunk
    bias = torch.randn(CHUNK + 300, generator=g).bfloat16()
    x = torch.randn(max(ROW_COUNTS), 576, generator=g).bfloat16()
    reference = upcast_linear(x[:1].float(), weight, bias)  # float32 in and out: no rounding hides a change
    for n in ROW_COUNTS:
        out = upcast_linear(x[:n].float(), weight, bias)
        assert torch.equal(out[:1], reference), f"row 0 changed when {n} rows share the product"
        out = upcast_linear(x[:n], weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (n, weight.shape[0])
        exact = F.linear(x[:n].double(), weight.double(), bias.double())
        assert torch.allclose(out.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.fixture()
def upcast_everywhere(monkeypatch, use_options):
    """The float32 path whatever this CPU has (without Options.exact, and by default only without a bf16 unit)."""
    use_options(exact=False)
    monkeypatch.setattr(upcast, "UPCAST_HELPS", True)


def prefill(target, prompts: list[list[int]], is_prefill: bool = True) -> list[torch.Tensor]:
    """Final hidden states of each prompt, prefilled together in one forward."""
    c = target.config
    cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                    target.dtype, max(map(len, prompts)), slots=len(prompts), capacity=max(map(len, prompts)))
    cache.num_used = len(prompts)
    lens = [len(p) for p in prompts]
    batch = FlatBatch(torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(n) for n in lens]),
                      lens, prefill=is_prefill)
    hidden = target(batch, cache).hidden
    return list(hidden.split(lens))


def test_a_prefill_does_not_depend_on_what_is_admitted_with_it(llm_bf16, chat_prompts, upcast_everywhere):
    target = llm_bf16.engine.target
    short, *others = [llm_bf16.chat_prompt(p) for p in chat_prompts]
    alone = prefill(target, [short[:2]])[0]  # two rows: padded to the float32 kernel's minimum
    together = prefill(target, [short[:2], *others])[0]
    assert torch.equal(alone, together)
    whole = prefill(target, [short])[0]
    assert torch.equal(whole, prefill(target, [others[0], short])[1])
    upcast.UPCAST_HELPS = False  # (restored by the fixture)
    bf16 = prefill(target, [short])[0]  # the same model in bf16 products: float32 products round less
    assert not torch.equal(bf16, whole) and (bf16.float() - whole.float()).abs().max() < 0.05 * bf16.float().abs().max()


def test_the_target_takes_the_float32_path_for_a_prefill_or_many_rows(llm_bf16, upcast_everywhere, monkeypatch):
    target, calls = llm_bf16.engine.target, []
    monkeypatch.setattr(upcast, "upcast_linear", lambda x, w, b: calls.append(len(x)) or F.linear(x, w, b))
    # many: beyond skinny.py's few-row kernel too, which decode and verify forwards of few rows take first
    few, many = list(range(1, upcast.MANY_ROWS)), list(range(1, max(upcast.MANY_ROWS, MAX_ROWS + 1) + 1))
    for tokens, is_prefill, expect in ((few, False, False), (few, True, True), (many, False, True)):
        calls.clear()
        hidden = torch.cat(prefill(target, [tokens], is_prefill))
        target.logits(hidden)
        assert bool(calls) == expect and all(n == len(tokens) for n in calls), (len(tokens), is_prefill, calls)
    monkeypatch.setattr(upcast, "UPCAST_HELPS", False)  # float32 targets and CPUs with a bf16 unit: never
    calls.clear()
    target.logits(torch.cat(prefill(target, [many])))
    assert not calls
