"""Tiny random models for the drafter and training tests: a 6-layer Llama target (random weights, saved as a
Hugging Face folder with a word-level tokenizer, so `load_target` and the Trainer read it like any other),
DSpark drafters of every head type over it, and random training data. Everything runs in float32 in
well under a second per forward.

Import the fixtures into a test module (`from tiny_models import tiny_target, tiny_target_dir`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dspark.draft.checkpoint import draft_config
from dspark.draft.dspark_model import DSparkModel
from dspark.target.loading import load_target
from dspark.target.model import TargetModel

VOCAB, HIDDEN, TARGET_LAYERS = 512, 64, 6
BLOCK, RANK = 4, 8  # drafter block size γ and Markov rank r
HEAD_KINDS = ("dflash", "vanilla", "gated", "rnn")  # "dflash": markov_rank 0, no sequential head
FIRST_TOKEN = 3  # ids below are special (t0 unk, t1 eos, t2 bos); random data avoids them


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 6-layer Llama (hidden 64, 4 heads, 2 KV heads). Weights drawn with std 0.25, so that its next-token
    distributions are far from uniform; a non-default rope theta, so that a rotary fallback shows."""
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.25, tie_word_embeddings=False, bos_token_id=2, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return LlamaConfig(**{**fields, **overrides})


def save_tiny_target(folder: Path, seed: int = 0) -> Path:
    """Random tiny Llama weights and a word-level tokenizer ("t0" .. "t511") in a Hugging Face folder."""
    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2")
    tokenizer.save_pretrained(folder)
    return folder


def meta_target(**overrides) -> TargetModel:
    """A weightless tiny target (only its config counts), e.g. with another vocabulary."""
    with torch.device("meta"):
        return TargetModel(tiny_llama_config(**overrides))


def drafter_config(target: TargetModel, kind: str = "vanilla", block_size: int = BLOCK, **fields) -> dict:
    rank = 0 if kind == "dflash" else RANK
    return draft_config(target.config.to_dict(), num_layers=1, block_size=block_size, markov_rank=rank,
                        markov_head_type="vanilla" if kind == "dflash" else kind, num_features=3, num_anchors=8,
                        **fields)


def tiny_drafter(target: TargetModel, kind: str = "vanilla", seed: int = 0, **fields) -> DSparkModel:
    """A randomly initialised float32 drafter sharing the target's embedding and LM head (as in training)."""
    torch.manual_seed(seed)
    model = DSparkModel(drafter_config(target, kind, **fields)).float()
    model.embed_tokens.weight, model.lm_head.weight = target.embed_tokens.weight, target.lm_head.weight
    return model


def random_tokens(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=generator).tolist()


def write_train_data(path: Path, lengths: list[tuple[int, int]], seed: int = 0) -> Path:
    """A regenerated-data JSONL: one record per (prompt length, answer length) with random token ids."""
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i, (n_prompt, n_answer) in enumerate(lengths):
            f.write(json.dumps({"id": f"rec/{i}", "prompt_ids": random_tokens(n_prompt, g),
                                "answer_ids": random_tokens(n_answer, g)}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir) -> TargetModel:
    """The tiny target in float32 (do not modify: shared by the session)."""
    return load_target(str(tiny_target_dir), torch.float32)[0]


@pytest.fixture(scope="module")
def one_thread():
    """Run tiny models on one thread: on a busy machine, extra threads only wait for each other (tiny
    ops run 50x slower with two threads on two shared cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
