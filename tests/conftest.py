"""Shared fixtures: benchmark prompts, the bundled SmolLM2 target (loaded once per session) and engines
built on it, and reference greedy outputs.

Sections: data | targets and engines | reference outputs. Fixtures for other test families go in their
own section below.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from dspark import LLM, SamplingParams, options

torch.set_num_threads(int(os.environ.get("DSPARK_TEST_THREADS", 2)))  # 1 beside another torch job

REPO = Path(__file__).resolve().parents[1]

NEW_TOKENS = 48  # greedy continuation length of the reference outputs


# ---- figures a test reports (printed at the end of the run, as CI logs keep them) ---------------------------
REPORTED: list[str] = []


@pytest.fixture
def report():
    """report(line): a figure for the run's summary (agreement figures, fuzz counts), whatever pytest captures."""
    return REPORTED.append


def pytest_terminal_summary(terminalreporter):
    if REPORTED:
        terminalreporter.section("reported figures")
        for line in REPORTED:
            terminalreporter.write_line(line)


# ---- data ---------------------------------------------------------------------------------------
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_prompts() -> list[dict]:
    """tests/fixtures/prompts.jsonl: {"kind", "prompt"} rows written for the tests."""
    return [json.loads(line) for line in (FIXTURES / "prompts.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def chat_prompts() -> list[str]:
    """Four prompts of different kinds from the fixtures: two math, one code, one chat."""
    rows = fixture_prompts()
    return [r["prompt"] for r in rows if r["kind"] == "math"][:2] + [
        next(r["prompt"] for r in rows if r["kind"] == kind) for kind in ("code", "chat")]


@pytest.fixture
def use_options():
    """use_options(**changes): dspark.Options with these fields changed for the rest of the test."""
    saved = options.current()
    yield lambda **changes: options.use(dataclasses.replace(options.current(), **changes))
    options.use(saved)


# ---- targets and engines ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def base_llm_fp32() -> LLM:
    """The bundled SmolLM2 target in float32, plain decoding; share its weights via `make_llm`."""
    return LLM(dtype="fp32", max_num_seqs=16)


@pytest.fixture(scope="session")
def smollm_fp32(base_llm_fp32):
    """(TargetModel, tokenizer, folder) of the bundled target in float32."""
    return base_llm_fp32.engine.target, base_llm_fp32.tokenizer, base_llm_fp32.target_path


@pytest.fixture(scope="session")
def make_llm(base_llm_fp32):
    """make_llm(drafter="none", scheduler="fixed", gamma=7, **config) -> a fresh LLM (own engine, cache and
    queues) on the shared float32 SmolLM2 weights, as LLM(dtype="fp32", ...) builds it; config fields:
    max_num_seqs, max_model_len."""

    def make(drafter="none", scheduler="fixed", gamma: int = 7, **config) -> LLM:
        return base_llm_fp32.sibling(drafter, scheduler, gamma=gamma, **config)

    return make


@pytest.fixture(scope="session")
def llm_bf16() -> LLM:
    """The bundled target in bfloat16 (the default dtype) with prompt lookup, as the CLI runs it."""
    return LLM(dtype="bf16", drafter="prompt-lookup", max_num_seqs=8)


# ---- reference outputs --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def greedy() -> SamplingParams:
    """Greedy decoding of NEW_TOKENS at most: the settings of the reference outputs."""
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="session")
def chat_ids(base_llm_fp32, chat_prompts) -> list[list[int]]:
    """Token ids of chat_prompts under the chat template."""
    return [base_llm_fp32.chat_prompt(p) for p in chat_prompts]


@pytest.fixture(scope="session")
def solo_greedy(make_llm, chat_ids, greedy) -> list[list[int]]:
    """Greedy fp32 output ids of each chat prompt decoded alone, without drafts."""
    llm = make_llm()
    return [llm.generate(ids, greedy)[0].token_ids for ids in chat_ids]


@pytest.fixture(scope="session")
def solo_greedy_bf16(llm_bf16, chat_ids, greedy) -> list[list[int]]:
    """Greedy bf16 output ids of each chat prompt decoded alone, without drafts."""
    llm = llm_bf16.sibling(max_num_seqs=1)
    return [llm.generate(ids, greedy)[0].token_ids for ids in chat_ids]
