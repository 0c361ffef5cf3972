"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import copy
import dataclasses

import torch
from tqdm import tqdm

from ..config import EngineConfig
from ..options import Options
from ..options import use as use_options
from ..auto import choose_drafter, scheduler_for
from ..draft import default_fits, make_drafter
from ..draft.lookup_first import LookupFirstDrafter
from ..sampling import SamplingParams
from ..schedule import NEEDS_COST_TABLE, CostTable, FixedLength, make_scheduler
from .profile import cached_profile
from ..target.loading import load_target
from .llm_engine import LLMEngine
from .request import RequestOutput


class LLM:
    """Load a target (and a drafter), then generate for many prompts with continuous batching.

    target: None for the bundled SmolLM2-135M-Instruct, a Hugging Face folder, a .gguf file or a hub id
    in the local cache. drafter: "none", "prompt-lookup", "default" (the bundled DSpark drafter), "auto" (auto.py's
    policy: that one where it fits the target, with max_num_seqs 1 behind prompt lookup, else prompt lookup), a drafter folder
    (DSpark, DFlash, Eagle3-style), "lookup+default" / "lookup+FOLDER" (prompt lookup first) or a Drafter.
    scheduler: "fixed", "plain", "threshold", "algorithm1", "async", "auto" (async where the drafter gives
    confidences, else fixed) or a Scheduler; algorithm1 and async cost steps with an SPS(B) table: `cost_table`
    (a file from `dspark profile`), else one profiled for this target, drafter and machine at first use and
    cached (profile=False: a provisional table instead, corrected online, so that a server opens at once).
    options: how the target computes (dspark.Options; None keeps the ones in force, by default exact).
    """

    def __init__(self, target: str | None = None, drafter="none", scheduler="fixed", *, gamma: int = 7,
                 dtype: str = "bf16", max_num_seqs: int = 64, max_model_len: int | None = None,
                 threads: int | None = None, cost_table: str | CostTable | None = None, threshold: float = 0.5,
                 options: Options | None = None, profile: bool = True):
        if options is not None:
            use_options(options)
        self.config = EngineConfig(target=target, dtype=dtype, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, threads=threads)
        if threads:
            torch.set_num_threads(threads)
        model, self.tokenizer, self.target_path = load_target(target, self.config.torch_dtype, self.config.q4_1)
        self.profile = profile
        self._build_engine(model, drafter, scheduler, gamma, cost_table, threshold)

    def _build_engine(self, model, drafter, scheduler, gamma, cost_table, threshold):
        max_len = self.config.max_model_len or model.config.max_position_embeddings
        drafter = choose_drafter(drafter, scheduler, self.config.max_num_seqs, default_fits(model))
        made = make_drafter(drafter, gamma, model, max_len)
        if isinstance(made, LookupFirstDrafter):  # its sources cut their own drafts (a long repeat's to 2 gamma)
            gamma = made.gamma
        self.engine = LLMEngine(model, self.tokenizer, made, FixedLength(gamma), self.config)
        scheduler = scheduler_for(scheduler, self.engine.drafter)
        if scheduler in NEEDS_COST_TABLE and not isinstance(cost_table, CostTable):
            key = (str(self.target_path), str(drafter), self.config.dtype, self.config.max_num_seqs,
                   torch.get_num_threads())
            cost_table = CostTable.load(cost_table) if cost_table else cached_profile(self.engine, key, self.profile)
        self.engine.scheduler = make_scheduler(scheduler, gamma=gamma, cost=cost_table, threshold=threshold)

    def sibling(self, drafter="none", scheduler="fixed", *, gamma: int = 7, cost_table=None, threshold: float = 0.5,
                **config) -> "LLM":
        """Another LLM on the same target weights, with its own engine, KV cache, drafter and scheduler;
        config overrides EngineConfig fields (max_num_seqs, max_model_len)."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, **config)
        other._build_engine(self.engine.target, drafter, scheduler, gamma, cost_table, threshold)
        return other

    def chat_prompt(self, messages: list[dict] | str) -> list[int]:
        """Token ids of a conversation (or one user message) under the target's chat template."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages:
            raise ValueError("empty message list")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat: bool = False, use_tqdm: bool = False, on_output=None) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or with chat=True a message list / user text).

        Returns one finished RequestOutput per prompt, in order. A request that fails is returned with
        finish_reason "error" and its message; the others are unaffected.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        inputs = [self.chat_prompt(p) if chat else p for p in prompts]
        reqs = []
        try:
            for x, sp in zip(inputs, params):
                reqs.append(self.engine.add_request(x, sp, on_output=on_output))
        except Exception:  # a bad prompt: queue none of this call's requests
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm)
        while any(not r.finished for r in reqs):
            for out in self.engine.step():
                bar.update(out.finished)
        bar.close()
        return [r.output("") for r in reqs]
