"""The engine loop: continuous batching with speculative decoding, one step at a time.

A step admits waiting requests (prefill), then runs the data path of docs/design.md for every running
request: schedule and propose -> plan -> verify -> accept -> commit -> emit, each a method below. The target side
(batches, forwards, the KV cache's rows) is the model runner's (model_runner.py); this class keeps the requests.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from ..config import EngineConfig
from ..draft.base import Drafter, NoDrafter
from ..sampling import SamplingParams, param_tensors, sample, token_logprobs, warp
from ..schedule.base import FixedLength, Scheduler
from ..schedule.drift import DriftMonitor
from ..schedule.survival import expected_tau, prefix_survival
from ..kernels.argmax import argmax_rows
from ..target.kv_cache import KVCache
from ..target.model import FlatBatch, TargetModel
from ..proposal import Proposal
from ..verify import Verdict, greedy_verdict, rejection_sample, tree_verdict
from .emit import append_tokens
from .model_runner import ModelRunner
from .request import Request, RequestOutput, Status
from .stats import StepStats


class LLMEngine:
    def __init__(self, target: TargetModel, tokenizer, drafter: Drafter | None = None,
                 scheduler: Scheduler | None = None, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.target, self.tokenizer = target, tokenizer
        self.drafter = drafter or NoDrafter()
        self.scheduler = scheduler or FixedLength()
        self.capture_layers = target.capture_layers = tuple(self.drafter.target_layer_ids)
        tc = target.config
        self.max_model_len = self.config.max_model_len or tc.max_position_embeddings
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self.cache = KVCache(tc.num_hidden_layers, tc.num_key_value_heads, head_dim, target.dtype, self.max_model_len)
        self.runner = ModelRunner(target, self.cache, self.capture_layers)
        self.eos_ids = self._eos_ids()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i].slot == i
        self.stats: deque[StepStats] = deque(maxlen=100_000)
        self.max_prefill_tokens = 4096
        self.record_confidence = False  # keep each step's c[R, γ] in its stats (calibration reads them)
        self.drift: DriftMonitor | None = None  # online calibration check and STS re-fit (watch_calibration)

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.target.config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return {i for i in ids if i is not None}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, on_output=None) -> Request:
        req = self.new_request(prompt, params, request_id, on_output)
        self.waiting.append(req)
        return req

    def new_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, on_output=None) -> Request:
        """A checked request, not yet queued (a server builds it on its own thread, then hands it over)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} "
                             f"tokens (at least one new token must fit)")
        vocab = self.target.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        req = Request(ids, params, on_output=on_output)
        if request_id is not None:
            req.request_id = request_id
        return req

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request; its KV slot and drafter state are freed at once. Returns it (None: not in flight)."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return req
        for req in self.running:
            if req.request_id == request_id:
                self._finish(req, "abort")
                self._release([req])
                return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        st = StepStats()
        t0 = time.perf_counter()
        outputs = self._admit(st)
        st.t_prefill = time.perf_counter() - t0
        self._release([r for r in self.running if r.finished])  # slots stay contiguous: a batch's rows are slots
        reqs = list(self.running)
        if reqs:
            outputs += self._decode_isolating(reqs, st)
            st.t_total = time.perf_counter() - t0
            if st.num_requests:  # a step that failed and was retried request by request is not a measurement
                self.stats.append(st)
                self.scheduler.observe(st)
        self._release([r for r in self.running if r.finished])
        return outputs

    def _decode_isolating(self, reqs: list[Request], st: StepStats) -> list[RequestOutput]:
        """One request can only fail itself: when a step's decode raises before it commits anything, each request
        decodes alone (its generator rewound to the step's start, so its draws are the ones it would have made),
        and only those that fail alone fail; the engine keeps serving."""
        saved = [(req.num_cached, req.generator.get_state()) for req in reqs]
        try:
            return self._decode(reqs, st)
        except Exception as exc:
            if len(reqs) == 1 or any(req.num_cached != n for req, (n, _) in zip(reqs, saved)):
                return self._fail(reqs, exc)
        outputs = []
        for req, (_, state) in zip(reqs, saved):
            req.generator.set_state(state)
            try:
                outputs += self._decode([req], StepStats())
            except Exception as exc:
                outputs += self._fail([req], exc)
        return outputs

    def _decode(self, reqs: list[Request], st: StepStats) -> list[RequestOutput]:
        t = time.perf_counter()
        room = self._room(reqs)
        proposal = self._propose(reqs, room, st)  # 1. schedule the draft, propose
        st.t_draft, t = time.perf_counter() - t, time.perf_counter()
        lengths = self._plan(proposal, room)  # 2. plan
        st.t_plan, t = time.perf_counter() - t, time.perf_counter()
        greedy = all(r.params.greedy for r in reqs)
        batch, out, logits = self.runner.verify(reqs, proposal, lengths, len(self.running), not greedy)  # 3. verify
        st.t_verify, t = time.perf_counter() - t, time.perf_counter()
        verdict = self._accept(reqs, logits, batch, proposal, lengths, greedy)  # 4. accept
        if not bool(((verdict.next_token >= 0) & (verdict.next_token < logits.shape[-1])).all()):
            raise ValueError("a sampled token fell outside the vocabulary (the probabilities were not finite)")
        paths = verdict.path or [list(range(n)) for n in verdict.num_accepted.tolist()]  # the accepted drafts
        new_tokens = [proposal.tokens[i, path].tolist() + [int(verdict.next_token[i])] for i, path in enumerate(paths)]
        rows = [[s + k for k in [0, *(j + 1 for j in path)]] for s, path in zip(batch.starts.tolist(), paths)]
        scores = self._logprobs(reqs, logits, rows, new_tokens)  # each new token's row: the one that decided it
        self._commit(reqs, batch, out.features, [len(t) for t in new_tokens], walks=verdict.path)  # 5. commit
        st.t_sample = time.perf_counter() - t
        self._record(st, reqs, proposal, lengths, verdict, batch)
        st.first = (reqs[0].request_id, proposal.tokens[0, :int(lengths[0])].tolist(), new_tokens[0])
        return self._emit(reqs, new_tokens, scores)  # 6. emit

    def _propose(self, reqs: list[Request], room: torch.Tensor, st: StepStats) -> Proposal:
        """The drafter's proposal, drafting no further than any request could verify and the scheduler wants (an
        empty one where the scheduler wants none: the drafter does not run)."""
        limit = int(room.max())
        cap = min(limit, self.drafter.gamma) if self.drafter.gamma else limit  # a drafter may leave gamma unset
        slots = int(room.clamp(max=cap).sum())  # drafts this step could verify
        wanted = self.scheduler.draft_limit(len(reqs), slots)  # drafts past it would never be verified
        st.draft_skipped = wanted == 0
        if st.draft_skipped:
            return Proposal.empty(len(reqs))
        return self.drafter.propose(reqs, limit if wanted is None else min(limit, wanted))

    def _plan(self, proposal: Proposal, room: torch.Tensor) -> torch.Tensor:
        """Drafts each request verifies: the scheduler's plan, within what was proposed and what fits."""
        return torch.minimum(torch.minimum(self.scheduler.plan(proposal), proposal.lengths), room).long()

    def _record(self, st: StepStats, reqs: list[Request], proposal: Proposal, lengths: torch.Tensor,
                verdict: Verdict, batch: FlatBatch) -> None:
        """The step's statistics and each request's counts."""
        accepted = verdict.num_accepted.tolist()
        st.num_requests, st.verify_tokens = len(reqs), int(batch.tokens.numel())
        st.drafted, st.verified, st.accepted = proposal.lengths.tolist(), lengths.tolist(), accepted
        if proposal.confidence is not None:
            st.expected_tau = expected_tau(prefix_survival(proposal.confidence, proposal.lengths), lengths)
            st.confidence = proposal.confidence.tolist() if self.record_confidence else None
            if self.drift is not None:
                self._recalibrate(proposal.confidence.tolist(), lengths.tolist(), accepted)
        elif st.draft_skipped and self.drafter.has_confidence:  # nothing verified: τ is 1 per request, surely
            st.expected_tau = float(len(reqs))
        for req, n, v in zip(reqs, accepted, st.verified):
            req.drafts_verified += v
            req.drafts_accepted += n
            req.steps += 1

    def watch_calibration(self, monitor: DriftMonitor | None) -> None:
        """Check the confidence head's calibration against what is accepted, step by step, and re-fit its STS
        temperatures when it drifts (schedule/drift.py); None stops. Only which drafts are verified can change."""
        if monitor is not None and not (self.drafter.has_confidence and hasattr(self.drafter, "temperatures")):
            raise ValueError("online calibration needs a drafter with a confidence head")
        self.drift = monitor

    def _recalibrate(self, confidence: list[list[float]], verified: list[int], accepted: list[int]) -> None:
        temperatures = self.drift.observe(confidence, verified, accepted)
        if temperatures is not None:  # the step's drafts are made: the next proposal reads them
            self.drafter.temperatures = temperatures

    # ---- pieces of the step ---------------------------------------------------------------------
    def _admit(self, st: StepStats) -> list[RequestOutput]:
        """Prefill waiting requests (up to max_num_seqs running and max_prefill_tokens) and sample
        their first token. Requests admitted together with the same prompt share one prefill: the first of
        them is computed, the others copy its keys and values (n samples of one prompt cost one prefill)."""
        new = self._take_waiting()
        if not new:
            return []
        row: dict[tuple[int, ...], int] = {}  # a prompt -> its row in the prefill batch
        computed, copies, copy_rows = [], [], []
        for req in new:
            key = tuple(req.prompt_ids)
            if key in row:
                copies.append(req)
                copy_rows.append(row[key])
            else:
                row[key] = len(computed)
                computed.append(req)
        new = computed + copies  # the computed prompts take the first slots
        for req in new:
            req.slot = self.cache.allocate()
            req.status, req.admitted_at = Status.RUNNING, time.perf_counter()
            self.running.append(req)
        lens = [len(r.prompt_ids) for r in computed]
        source = torch.tensor([*range(len(computed)), *copy_rows])  # each request's row in the batch
        try:
            batch, out = self.runner.prefill([r.prompt_ids for r in computed], new[0].slot, len(self.running))
            for req, i in zip(copies, copy_rows):
                self.runner.copy_slot(computed[i].slot, req.slot, lens[i])
            logits = self.target.logits(out.hidden[batch.last_index])[source]
            p = warp(logits, *param_tensors([r.params for r in new]))
            first_tokens = sample(p, torch.cat([r.uniforms(1) for r in new])).tolist()
            self._commit(new, batch, out.features, [len(r.prompt_ids) for r in new], source)
        except Exception as exc:  # the forward failed: these requests fail, the engine goes on
            return self._fail(new, exc)
        st.prefill_tokens, st.admitted = sum(lens), len(new)
        vocab = logits.shape[-1]
        bad = [r for r, t in zip(new, first_tokens) if not 0 <= t < vocab]  # a row whose probabilities broke
        failed = self._fail(bad, ValueError("the first token fell outside the vocabulary (probabilities not finite)"))
        good = [i for i, t in enumerate(first_tokens) if 0 <= t < vocab]
        scores = self._logprobs([new[i] for i in good], logits, [[i] for i in good], [[first_tokens[i]] for i in good])
        return failed + self._emit([new[i] for i in good], [[first_tokens[i]] for i in good], scores)

    def _take_waiting(self) -> list[Request]:
        """Waiting requests to admit now: up to max_num_seqs running, and max_prefill_tokens of prompts
        (a prompt already taken this step costs nothing more)."""
        taken: list[Request] = []
        seen: set[tuple[int, ...]] = set()
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(taken) < self.config.max_num_seqs:
            prompt = tuple(self.waiting[0].prompt_ids)
            cost = 0 if prompt in seen else len(prompt)
            if taken and cost > budget:
                break
            taken.append(self.waiting.popleft())
            seen.add(prompt)
            budget -= cost
        return taken

    def _room(self, reqs: list[Request]) -> torch.Tensor:
        """Drafts each request can still verify: its context and its max_tokens leave room for the drafts
        plus the one token every step adds."""
        return torch.tensor([min(self.max_model_len - r.num_cached - 1, r.params.max_tokens - len(r.output_ids)) - 1
                             for r in reqs]).clamp(min=0)

    def _accept(self, reqs: list[Request], logits: torch.Tensor, batch: FlatBatch, proposal: Proposal,
                lengths: torch.Tensor, greedy: bool):
        """Chain rejection sampling of the verified drafts (verify.py); a step of greedy requests only needs each
        row's argmax (and draft trees, greedy only, the walk down the argmax children: draft/tree.py)."""
        if proposal.parents is not None:  # draft trees (draft/tree.py): greedy steps only
            if not greedy:
                raise ValueError("draft trees are verified for greedy requests only")
            return tree_verdict(argmax_rows(logits), batch.starts, proposal.tokens, proposal.parents, lengths)
        if greedy:
            return greedy_verdict(argmax_rows(logits), batch.starts, proposal.tokens, lengths)
        p = warp(logits, *param_tensors([r.params for r in reqs], (1 + lengths).tolist()))
        G = proposal.tokens.shape[1]
        u = torch.stack([r.uniforms(G + 1) for r in reqs])
        return rejection_sample(p, batch.starts, proposal.tokens, proposal.q, lengths, u[:, :G], u[:, G])

    def _commit(self, reqs: list[Request], batch: FlatBatch, features, committed: list[int],
                source: torch.Tensor | None = None, walks: list[list[int]] | None = None):
        """Keep the first committed[r] positions of each request's forward; the rest roll back. Request r's
        positions are those of the batch's request source[r] (default r: its own). walks: per request, the drafts a
        draft tree's verification accepted, whose rows (draft k: row k + 1) move up behind the last token
        (draft/tree.py)."""
        starts = (batch.starts if source is None else batch.starts[source]).tolist()
        kept = [range(n) for n in committed] if walks is None else [[0] + [k + 1 for k in walk] for walk in walks]
        for req, keep in zip(reqs, kept):
            self.runner.keep(req.slot, req.num_cached, list(keep))
            req.num_cached += len(keep)
        if features is not None:
            at = [slice(s, s + len(keep)) if walks is None else torch.tensor(keep) + s for s, keep in zip(starts, kept)]
            self.drafter.commit(reqs, [batch.tokens[i] for i in at], [features[i] for i in at])

    @staticmethod
    def _logprobs(reqs: list[Request], logits: torch.Tensor, rows: list[list[int]], new_tokens: list[list[int]]):
        """Per request that asked for them (params.logprobs), the target's log-probabilities of its new tokens, from
        the logits rows that decided them; None for the others."""
        return [None if req.params.logprobs is None else token_logprobs(logits[r], tokens, req.params.logprobs)
                for req, r, tokens in zip(reqs, rows, new_tokens)]

    def _emit(self, reqs: list[Request], new_tokens: list[list[int]], scores: list | None = None) -> list[RequestOutput]:
        outputs = []
        for req, tokens, score in zip(reqs, new_tokens, scores or [None] * len(reqs)):
            try:
                before = len(req.output_ids)
                delta = append_tokens(req, tokens, self.tokenizer, self.eos_ids, self.max_model_len)
                if score is not None:  # the tokens kept (EOS, max_tokens and the context may stop early)
                    req.logprobs += score[:len(req.output_ids) - before]
                out = req.output(delta)
                if req.on_output is not None and (delta or req.finished):
                    req.on_output(out)
            except Exception as exc:  # one request's failure never stops the others
                out = self._fail([req], exc)[0]
            outputs.append(out)
        return outputs

    def _fail(self, reqs: list[Request], exc: Exception) -> list[RequestOutput]:
        outs = []
        for req in reqs:
            req.error = f"{type(exc).__name__}: {exc}"
            self._finish(req, "error")
            outs.append(req.output(""))
        return outs

    def _finish(self, req: Request, reason: str):
        req.status, req.finish_reason = Status.FINISHED, reason

    def _release(self, done: list[Request]):
        """Free finished requests' KV slots (highest slot first, so moves never touch a pending one)."""
        for req in sorted(done, key=lambda r: r.slot, reverse=True):
            if req.slot < 0:
                continue
            moved = self.cache.free(req.slot, self.running[-1].num_cached)
            self.drafter.release(req, moved)
            if moved is not None:
                self.running[req.slot] = self.running[moved]
                self.running[req.slot].slot = req.slot
            self.running.pop()
            req.slot = -1
