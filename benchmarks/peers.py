"""The systems a benchmark compares, behind one call: generate n greedy tokens for a batch of prompt token ids
(exactly n, or with stop_at_eos up to n, ending at the end-of-sequence token) and return the new ids. dspark
(LLM), transformers `generate` (left-padded batches, optional prompt lookup) and llama.cpp (llama-cpp-python,
batch 1, optional)."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import torch

from dspark import SamplingParams
from dspark.target.loading import bundled_gguf


def check_lengths(system: str, outputs: list[list[int]], n: int, stop_at_eos: bool = False) -> list[list[int]]:
    """Every peer must produce exactly n tokens per prompt (with stop_at_eos, 1 to n), or the tokens/s are not
    comparable."""
    bad = [len(o) for o in outputs if not (0 < len(o) <= n if stop_at_eos else len(o) == n)]
    if bad:
        raise RuntimeError(f"{system} produced {bad[:4]} tokens instead of {n}")
    return outputs


class DsparkPeer:
    """dspark's offline API, greedy; with ignore_eos every request makes exactly n tokens (stop_at_eos: up to n, as
    `dspark generate` does).

    history keeps every RequestOutput (for acceptance figures); clear it when you like.
    """

    def __init__(self, llm, name: str, stop_at_eos: bool = False):
        self.llm, self.name, self.stop_at_eos = llm, name, stop_at_eos
        self.history = []

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not self.stop_at_eos)
        outs = self.llm.generate(prompts, params)
        errors = [o.error for o in outs if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"{self.name} failed: {errors[0]}")
        self.history += outs
        return check_lengths(self.name, [o.token_ids for o in outs], n, self.stop_at_eos)


def load_transformers(folder: str | Path, dtype: torch.dtype):
    """(model, tokenizer) from a Hugging Face folder, the tokenizer padding on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


class TransformersPeer:
    """transformers `generate`, greedy, min_new_tokens = max_new_tokens; batches padded on the left.

    generate_kwargs are passed through, e.g. prompt_lookup_num_tokens for prompt lookup (batch 1 only).
    """

    def __init__(self, model, tokenizer, name: str = "transformers generate", **generate_kwargs):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.generate_kwargs = generate_kwargs

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        enc = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        out = self.model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                  max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id, **self.generate_kwargs)
        return check_lengths(self.name, out[:, enc["input_ids"].shape[1]:].tolist(), n)


PROBE = """import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=1, n_ctx=64, verbose=False)
assert llm.create_completion("Hello", max_tokens=2, temperature=0)["choices"]
"""


@functools.cache
def llama_cpp_problem() -> str | None:
    """Why llama.cpp cannot join a benchmark on this machine, or None where it can: llama-cpp-python is not
    installed, or a two-token decode of the bundled GGUF failed in a child process (ggml's AMX backend
    segfaulted at the first decode on an Intel Xeon with AMX; the README gives a build without it)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (optional: pip install llama-cpp-python==0.3.36)"
    gguf = bundled_gguf()
    probe = subprocess.run([sys.executable, "-c", PROBE, str(gguf)], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        return (f"a test decode of {gguf.name} failed in a child process (exit {probe.returncode}; on an Intel "
                f"Xeon with AMX, build llama-cpp-python without ggml's AMX backend as the README says)")
    return None


class LlamaCppPeer:
    """llama.cpp on a GGUF through llama-cpp-python, greedy, batch 1, past the end-of-sequence token (stop_at_eos:
    ending at it, the token counted as dspark counts it).

    The prompt is given as token ids (the same vocabulary: dspark's bundled target is this GGUF converted).
    """

    name = "llama.cpp"

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int, stop_at_eos: bool = False):
        from llama_cpp import Llama

        self.gguf, self.stop_at_eos = Path(gguf), stop_at_eos
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, seed=0, verbose=False)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        outputs = []
        for ids in prompts:
            self.llm.reset()  # no reuse of the previous prompt's cached prefix
            tokens = []
            for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                           reset=True):
                tokens.append(int(token))
                if len(tokens) == n or (self.stop_at_eos and token == self.llm.token_eos()):
                    break
            outputs.append(tokens)
        return check_lengths(self.name, outputs, n, self.stop_at_eos)
