"""fused_layers.cpp runs the decoder layers of decode and verify forwards as model.py's layer loop does: the same
hidden states, captured features and KV cache writes within rounding (float32 and bf16; Llama, Qwen3 with its q/k
norms, Qwen2 with its q/k/v biases; ragged batches, more than 16 tokens, and a block that reads ahead), on this
CPU's instructions and on AVX2's; attention on AMX's tiles errs as the vector loops do; a request's results do not
depend on the requests beside it; prefills (except bf16 ones on AMX's tiles, which run each request alone in chunks),
forwards of more than MAX_TOKENS, Options.fused=False and models it cannot run keep the loop."""
import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen3Config

import dspark.kernels.fused_layers as fused_layers
import dspark.target.model as model_module
from dspark.kernels.fused_layers import MAX_TOKENS
from dspark.target.kv_cache import KVCache
from dspark.target.model import FlatBatch, TargetModel
from test_skinny import MARCHES, built, needs_tiles
from tiny_models import tiny_llama_config

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
CONFIGS = {"llama": lambda: tiny_llama_config(num_hidden_layers=3),
           "qwen3": lambda: Qwen3Config(**SHAPE, num_hidden_layers=3, head_dim=32, rope_theta=1000.0),
           "qwen2": lambda: Qwen2Config(**SHAPE, num_hidden_layers=3, rope_theta=1000.0)}
PROMPTS = [9, 20, 14]


def random_target(family: str, dtype: torch.dtype, **overrides) -> TargetModel:
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = TargetModel(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.rand(param.shape, generator=g) + 0.5 if "norm" in name else 0.2 * torch.randn(
                param.shape, generator=g)
            param.copy_(noise)
    model.capture_layers = (0, 2)
    return model.to(dtype)


def run(model: TargetModel, steps: list[tuple[list[int], bool]]):
    """Prefill PROMPTS, then forwards of the given query lengths (True: each request's block reads up to its last
    position, as a drafter block); returns each forward's (hidden, features) and the cache."""
    c = model.config
    cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, model.layers[0].self_attn.head_dim, model.dtype, 512,
                    len(PROMPTS), 64)
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, c.vocab_size, (n,), generator=g)
    model(FlatBatch(ids(sum(PROMPTS)), torch.cat([torch.arange(p) for p in PROMPTS]), PROMPTS, prefill=True), cache)
    lengths, outs = list(PROMPTS), []
    for query_lens, ahead in steps:
        cache.reserve(len(PROMPTS), max(n + q for n, q in zip(lengths, query_lens)))  # as the engine reserves
        positions = torch.cat([torch.arange(n, n + q) for n, q in zip(lengths, query_lens)])
        visible = torch.cat([torch.full((q,), n + q - 1) for n, q in zip(lengths, query_lens)]) if ahead else None
        out = model(FlatBatch(ids(sum(query_lens)), positions, query_lens, visible=visible), cache)
        outs.append((out.hidden, out.features))
        lengths = [n + q for n, q in zip(lengths, query_lens)]
    return outs, (cache.k, cache.v)


@pytest.fixture(autouse=True)
def prefills_in_the_loop(monkeypatch):
    """Prefills stay in model.py's loop here (bf16 ones on AMX would run fused): the decode and verify forwards
    compared and counted are the only fused ones. The prefill tests at the end switch it as they need."""
    monkeypatch.setattr(model_module, "fuses_prefill", lambda model: False)


@pytest.fixture
def fused_calls(monkeypatch):
    """The number of forwards that ran through fused_layers.cpp."""
    calls = []
    real = model_module.fused_forward
    monkeypatch.setattr(model_module, "fused_forward", lambda *a: calls.append(1) or real(*a))
    return calls


def tensors(outs, cache) -> list[torch.Tensor]:
    return [t.float() for pair in outs for t in pair] + [t.float() for t in cache]


STEPS = [([1, 5, 3], False), ([1, 1, 1], False), ([4, 2, 6], True), ([8, 7, 9], False)]  # the last: 24 tokens


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_the_layer_loop(family, dtype, march, fused_calls, monkeypatch, use_options):
    """float32: equal within 1e-5 of the largest value. bf16: both round at every step, differently where model.py's
    batched attention rounds its scores and probabilities to bf16, so each is compared with the float32 loop over
    the same weights: the fused forward's mean error is at most 1.15x the loop's (measured: 0.88-1.04x)."""
    monkeypatch.setattr(fused_layers, "kernel", lambda: built(march))
    model = random_target(family, dtype)
    use_options(fused=False)
    loop = tensors(*run(model, STEPS))
    exact = tensors(*run(copy.deepcopy(model).float(), STEPS))
    assert not fused_calls
    use_options(fused=True)
    fused = tensors(*run(model, STEPS))
    assert len(fused_calls) == len(STEPS)
    for ours, theirs, reference in zip(fused, loop, exact):
        if dtype == torch.float32:
            assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
        else:
            assert (ours - reference).abs().mean() <= 1.15 * (theirs - reference).abs().mean()


@needs_tiles
@pytest.mark.parametrize("head_dim", [32, 64])
def test_tile_attention_errs_as_the_vector_loops(head_dim, fused_calls, monkeypatch, use_options):
    """bf16 on AMX: the query rows of requests of 2 tokens or more attend on the tiles (tile_attention.h). Against
    the float32 loop, each output's mean error is at most 1.1x that of the same forwards with Options.tiles=False
    (measured: 0.93-1.06x; dividing the tiles' sums by 1.01x their normaliser reaches 1.20x)."""
    use_options(exact=False)  # tile attention is not exact: one token attends on the vector loops
    model = random_target("qwen3", torch.bfloat16, head_dim=head_dim)
    use_options(fused=False)
    exact = tensors(*run(copy.deepcopy(model).float(), STEPS))
    use_options(fused=True)
    tiles = tensors(*run(model, STEPS))
    use_options(tiles=False)
    vector = tensors(*run(model, STEPS))
    assert len(fused_calls) == 2 * len(STEPS)
    for ours, theirs, reference in zip(tiles, vector, exact):
        assert (ours - reference).abs().mean() <= 1.1 * (theirs - reference).abs().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_request_does_not_depend_on_the_requests_beside_it(dtype, fused_calls):
    model = random_target("qwen3", dtype)
    # request 0's 3 tokens beside 1 token of each other request, then beside 2 and 4 tokens
    few, _ = run(model, [([3, 1, 1], False)])
    more, _ = run(model, [([3, 2, 4], False)])
    assert len(fused_calls) == 2
    for a, b in zip(few[0], more[0]):  # hidden states and features
        assert torch.equal(a[:3], b[:3])


def test_prefills_unfusable_models_and_the_switch_keep_the_loop(fused_calls, monkeypatch, use_options):
    run(random_target("llama", torch.float32), [])  # a prefill only
    assert not fused_calls
    odd = random_target("llama", torch.float32, intermediate_size=120)  # not a multiple of 16
    assert not fused_layers.fusable(odd)
    run(odd, STEPS[:1])
    assert not fused_calls
    use_options(exact=False)
    run(random_target("llama", torch.float32), [([MAX_TOKENS // 3 + 1] * 3, False)])  # more than MAX_TOKENS
    assert not fused_calls
    use_options(exact=True)  # the same forward in pieces of whole requests, each fused
    run(random_target("llama", torch.float32), [([MAX_TOKENS // 3 + 1] * 3, False)])
    assert len(fused_calls) == 2
    fused_calls.clear()
    wide = [MAX_TOKENS + 5] + [1] * (len(PROMPTS) - 1)  # one request wider than MAX_TOKENS: runs of its tokens
    run(random_target("llama", torch.float32), [(wide, False)])
    assert len(fused_calls) == 3
    fused_calls.clear()
    use_options(fused=False)
    run(random_target("llama", torch.float32), STEPS[:1])
    assert not fused_calls


def prefill(model: TargetModel, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each prompt's hidden states after one prefill of them all (a fresh cache)."""
    c = model.config
    cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, model.layers[0].self_attn.head_dim, model.dtype, 512,
                    len(prompts), 64)
    cache.reserve(len(prompts), max(len(p) for p in prompts))
    lens = [len(p) for p in prompts]
    batch = FlatBatch(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens]), lens, prefill=True)
    return list(model(batch, cache).hidden.split(lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_prefills_run_each_request_alone_in_chunks(dtype, fused_calls, monkeypatch):
    """Where fuses_prefill (bf16 on AMX; forced here), a prefill runs request by request in chunks of at most
    MAX_TOKENS, the later chunks reading the earlier ones from the cache: the loop's results within rounding, and a
    prompt's rows the same whatever is admitted beside it (33 rows: a lone last row of a 32-row product)."""
    model = random_target("llama", dtype)
    g = torch.Generator().manual_seed(2)
    long, short, other = (torch.randint(3, 512, (n,), generator=g) for n in (MAX_TOKENS + 20, 33, 5))
    loop = prefill(model, [long, short])
    assert not fused_calls
    monkeypatch.setattr(model_module, "fuses_prefill", lambda model: True)
    fused = prefill(model, [long, short])
    assert len(fused_calls) == 3  # the long prompt in two chunks, the short one in one
    scale = max(x.float().abs().max() for x in loop)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    assert all((a.float() - b.float()).abs().max() < tolerance * scale for a, b in zip(fused, loop))
    assert torch.equal(prefill(model, [short])[0], fused[1]) and torch.equal(prefill(model, [other, short])[1], fused[1])


def test_prefills_fuse_under_exact_else_only_bf16_targets_on_the_tiles(monkeypatch, use_options):
    from dspark.kernels import skinny, upcast

    bf16 = random_target("llama", torch.bfloat16)
    assert fused_layers.fuses_prefill(bf16) == kernel_built()
    assert fused_layers.fuses_prefill(random_target("llama", torch.float32)) == kernel_built()
    use_options(exact=False)
    assert fused_layers.fuses_prefill(bf16) == (kernel_built() and skinny.runs_tiles() and not upcast.UPCAST_HELPS)
    assert not fused_layers.fuses_prefill(random_target("llama", torch.float32))
    monkeypatch.setattr(upcast, "UPCAST_HELPS", True)  # a CPU without a bf16 unit: the float32 path is faster
    assert not fused_layers.fuses_prefill(bf16)
    monkeypatch.setattr(upcast, "UPCAST_HELPS", False)
    use_options(fused=False)
    assert not fused_layers.fuses_prefill(bf16)


def kernel_built() -> bool:
    return fused_layers.kernel() is not None


@needs_tiles
def test_a_bundled_prefill_on_the_tiles_does_not_depend_on_what_is_admitted_with_it(llm_bf16, chat_prompts,
                                                                                    fused_calls, monkeypatch):
    target = llm_bf16.engine.target
    monkeypatch.setattr(model_module, "fuses_prefill", fused_layers.fuses_prefill)
    assert fused_layers.fuses_prefill(target)
    first, second = (torch.tensor(llm_bf16.chat_prompt(p)) for p in chat_prompts[:2])
    short, other = first[:33], second[:5]  # 33 rows alone: 32 on the tiles, one on the one-row kernel
    assert torch.equal(prefill(target, [short])[0], prefill(target, [other, short])[1]) and len(fused_calls) == 3
