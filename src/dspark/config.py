"""Engine settings in one place."""
from __future__ import annotations

from dataclasses import dataclass

# the torch dtype of each name (q4_1: 4-bit layer weights, target/q4_1.py, with bf16 activations); names only here, so
# the command line checks its flags without importing torch
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32", "q4_1": "bfloat16"}
SCHEDULERS = ("auto", "fixed", "plain", "threshold", "algorithm1", "async")  # schedule/ makes them
DTYPE_CHOICES = ["bf16", "fp32", "q4_1"]
DTYPE_HELP = ("weights: bf16, fp32, or q4_1 (the layers' weights in 4 bits, groups of 32, bf16 activations: exactly "
              "the bundled GGUF's own Q4_1 weights, a 4-bit quantization of any other target) (default: %(default)s)")


@dataclass
class EngineConfig:
    target: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "bf16"
    max_num_seqs: int = 64  # requests decoding at once; more wait
    max_model_len: int | None = None  # context limit; None: the target's max_position_embeddings
    threads: int | None = None  # torch intra-op threads; None: leave torch's default

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def q4_1(self) -> bool:
        return self.dtype == "q4_1"
