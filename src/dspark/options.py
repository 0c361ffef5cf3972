"""How dspark computes: one Options object, chosen once when an LLM (or the command line) loads a model.

Every switch of how dspark computes is a field here. `LLM(options=...)` and the CLI's flags make
one Options and install it with `use`; the kernels and the model read it with `current()`; benchmarks write
`asdict(current())` into their provenance. Nothing in the library reads the environment to decide how to compute.

exact is the numerics contract (docs/method.md, "Exactness"): every row of every forward of the target (decode,
verify of any width, draft trees, prefill chunks, any batch, any thread count) gives the bit-identical hidden
states, keys, values and logits that the same token gives when decoded alone. Speculative decoding then never
changes a greedy answer, and sampled answers follow exactly the distribution plain decoding samples from. It is
met by the compiled kernels themselves: products whose every output sums in one order whatever the rows, attention
token by token, and the one kernel for every width. Turning it off lets wider forwards take kernels that round
differently from one-row decoding (upcast.py's float32 products, AMX tile attention, one-row products off the AMX
tiles), which can be faster; see docs/method.md for what each costs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace

# this CPU's own instructions; AVX2; AVX-512; AVX-512 BF16; AMX; none (PyTorch's kernels only)
KERNEL_CHOICES = ("native", "haswell", "skylake-avx512", "cooperlake", "sapphirerapids", "pytorch")


@dataclass(frozen=True)
class Options:
    exact: bool = True  # the numerics contract above
    kernels: str = "native"  # -march of the compiled CPU kernels (native: this CPU), or "pytorch": none
    fused: bool = True  # forwards through fused_layers.cpp (every layer in one call)
    tiles: bool = True  # bf16 products on AMX's tiles where the CPU has them (a packed copy of each weight)
    tile_attention: bool = True  # several tokens' attention on AMX's tiles (only without exact)
    groups: bool = True  # float32 weights on a GGUF grid read as their groups (the same results, fewer bytes)
    draft_vocab: bool = True  # drafters draft from their draft vocabulary where they have one

    def __post_init__(self):
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"option {f.name} must be true or false, got {getattr(self, f.name)!r}")

    @property
    def compiled(self) -> bool:
        return self.kernels != "pytorch"


_current = Options()


def current() -> Options:
    """The options in force."""
    return _current


def use(options: Options | None) -> Options:
    """Install `options` (None: the defaults) for everything loaded and run from now on; returns the previous ones."""
    global _current
    previous, _current = _current, options or Options()
    return previous


@contextlib.contextmanager
def using(**changes):
    """The current options with `changes` while the block runs (tests and benchmarks compare settings this way)."""
    previous = use(replace(_current, **changes))
    try:
        yield _current
    finally:
        use(previous)
