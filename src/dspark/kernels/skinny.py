"""Products of few rows (decode and verify forwards) through a small compiled kernel, skinny.cpp.

A decode or verify forward multiplies a handful of rows by every weight of the model, so its products should
cost about one read of the weights. skinny.cpp streams each weight row once for all rows (4 rows of weights
against 4 rows of input per tile on AVX-512, bf16 pairs through vdpbf16ps where the CPU has AVX-512 BF16),
accumulates in float32, and gives every row the same result whatever else is in the product (tested), so
verifying 8 tokens rounds each of them as decoding it alone would. Each tile asks for the next tile's weight
rows ahead (prefetch): without it, products of several rows wait on memory. In verify forwards of SmolLM2-135M on
a 2-core EPYC with AVX-512 BF16 the kernel beats PyTorch's products from 1 to 16 tokens, its lead shrinking past 8
and gone in float32 at 16. Hence MAX_ROWS = 16: beyond it PyTorch's kernels (oneDNN's float32 inner product,
upcast.py's path on CPUs without a bf16 unit) run, and a row's rounding can then change with the number of rows in
the forward.

On Intel CPUs with AMX, bf16 products over a weight with a copy packed for the tile unit (`tiles`: made on first
use for the target's and the drafters' linear layers, so the bf16 weights take twice their memory on those CPUs)
run on the tiles (products of up to 32 rows; the layer loop passes at most MAX_ROWS), whose cost hardly grows with
the rows and whose weight tiles stream from memory in order: benchmarks/results/tiles.md (2-core AMX Xeon, all of
SmolLM2-135M's products and LM head, interleaved) has 8 rows at 14.0 ms over the copies against 22.1 ms without
them (vdpbf16ps), 32 rows 16.7 against 62.7, one row 11.2 against 11.5. Every row count runs there, so a row
still rounds alike whatever the rows beside it; with Options.exact one row runs on the tiles too (as every other
width), else on vdpbf16ps. Weights without a copy take vdpbf16ps; Options.tiles=False
makes none.

float32 products also read weights held as GGUF groups (groups.py), decoded in the tiles to the same values.

The kernel is compiled once per source, flags and CPU into the user cache folder (a few seconds with g++), in one
library with fused_layers.cpp (whole decode and verify forwards on these products), and loaded with ctypes; it
runs on PyTorch's OpenMP threads. Where there is no C++ compiler or no x86 AVX2 it is skipped with one warning, and
with Options.kernels="pytorch" it is not used: PyTorch's kernels (and model.py's layer loop) run instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .. import options
from ..cache import cache_root

SOURCE = Path(__file__).with_name("skinny.cpp")
# one library: the products, fused_layers.cpp's forwards built on them and argmax.cpp's greedy picks (simd.h: what
# they share; amx.h: what skinny.cpp's and tile_attention.h's AMX code share)
SOURCES = (SOURCE, SOURCE.with_name("fused_layers.cpp"), SOURCE.with_name("argmax.cpp"))
HEADERS = (SOURCE.with_name("simd.h"), SOURCE.with_name("amx.h"), SOURCE.with_name("tile_attention.h"))
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 16  # beyond, PyTorch's kernels are as fast or faster (see above)
DTYPES = {torch.bfloat16: "skinny_bf16", torch.float32: "skinny_f32"}


def cpu_signature() -> str:
    """The CPU's model and flags (the kernel is built for the CPU it runs on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def compile_kernel(out: Path, march: str) -> None:
    """Build SOURCES for -march=`march` into the shared library `out` (atomically: a half-written file is
    never loaded)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++; set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        command = [compiler, *FLAGS, f"-march={march}", *map(str, SOURCES), "-o", str(built)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{run.stderr[-2000:]}")
        os.replace(built, out)


ONE_ROW_TILES, TILE_ATTENTION = 1, 2  # the kernels' flags (skinny.cpp, fused_layers.cpp)


def kernel(march: str | None = None) -> ctypes.CDLL | None:
    """The kernel compiled for -march=`march` (default: Options.kernels, "native" being this CPU's own
    instructions), built on first use; None where Options.kernels is "pytorch" or it cannot be built (with one
    warning). Tests build older instruction sets too."""
    march = march or options.current().kernels
    return None if march == "pytorch" else built(march)


def flags() -> int:
    """The kernels' flags under the current options: exact puts one-row products on the AMX tiles (as every
    other width) and keeps attention on the vector loops, token by token."""
    o = options.current()
    return ONE_ROW_TILES if o.exact else TILE_ATTENTION * o.tile_attention


@functools.cache
def built(march: str) -> ctypes.CDLL | None:
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(code + " ".join(FLAGS).encode() + march.encode() + cpu_signature().encode()).hexdigest()
    path = cache_root() / "kernels" / f"skinny-{key[:16]}.so"
    try:
        if not path.exists():
            compile_kernel(path, march)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        warnings.warn(f"dspark: few-row products run on PyTorch's kernels (skinny.cpp not built: {err})",
                      stacklevel=2)
        return None
    for name in DTYPES.values():
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        getattr(lib, name).restype = None
    return lib


def kernel_name() -> str:
    """Which few-row kernel runs here: the compiled library's file name (source, flags and CPU), or "pytorch"
    (step-time profiles depend on it)."""
    lib = kernel()
    return "pytorch" if lib is None else Path(lib._name).name


def takes_skinny(x: torch.Tensor, weight: torch.Tensor, any_rows: bool = False) -> bool:
    """Whether x [..., K] @ weight.T takes the kernel: at most MAX_ROWS rows (any number with `any_rows`) of bf16
    or float32 on the CPU, the weight's own dtype, no autograd, and the kernel built."""
    return ((any_rows or x.numel() <= MAX_ROWS * x.shape[-1]) and x.dtype == weight.dtype and x.dtype in DTYPES and x.is_cpu
            and not torch.is_grad_enabled() and kernel() is not None)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  lib: ctypes.CDLL | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for few rows, through skinny.cpp (call where `takes_skinny` holds; `lib`: a
    kernel built for other instructions than `kernel()`; `packed`: the weight's `tiles`, the same result)."""
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    bias_ptr = None if bias is None else bias.data_ptr()
    packed_ptr = None if packed is None else packed.data_ptr()
    getattr(lib or kernel(), DTYPES[x.dtype])(rows.data_ptr(), weight.data_ptr(), packed_ptr, bias_ptr,
                                              out.data_ptr(), rows.shape[0], n, k, torch.get_num_threads(), flags())
    return out.view(*x.shape[:-1], n)


def tiles(linear: torch.nn.Module) -> torch.Tensor | None:
    """The bf16 weight [N, K] of `linear` packed for AMX's tiles: [N/16, K/32, 16, 16, 2], element [a, c, p, r, i]
    = weight[16a + r, 32c + 2p + i], so each tile (16 rows by 32 columns, as column pairs) is 1 KB contiguous and a
    block of 16 rows reads in order of k. Made on first use and kept on the module (a second copy of the weight);
    None where the CPU runs no tiles, the weight is not bf16, or N is no multiple of 16 or K of 32 (rows past the
    last whole 32 are read in place, on vdpbf16ps)."""
    weight = getattr(linear, "weight", None)
    if not (isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and runs_tiles()):
        return None
    n, k = weight.shape
    return kept(linear, "_tiles", identity(weight),
                lambda: weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous())


def kept(owner, name: str, key, make):
    """make() kept on `owner` as attribute `name`, made again when `key` changes (the copies and tables made of a
    model's weights)."""
    cached = getattr(owner, name, None)
    if cached is None or cached[0] != key:
        cached = (key, make())
        setattr(owner, name, cached)
    return cached[1]


def identity(t: torch.Tensor) -> tuple[int, int]:
    """What tells a tensor's values apart for the copies made of it: its storage and version (tensors made in
    inference mode keep no version and count as unchanged)."""
    return t.data_ptr(), -1 if t.is_inference() else t._version


def runs_tiles() -> bool:
    """Whether bf16 products run on AMX's tiles here: this CPU's kernel runs them, and Options.tiles (False saves the
    packed copies' memory)."""
    lib = kernel()
    return options.current().tiles and lib is not None and kernel_runs_tiles(lib)


@functools.cache
def kernel_runs_tiles(lib: ctypes.CDLL) -> bool:
    return bool(lib.skinny_tiles())
