"""`dspark train`: train a drafter against a frozen target on regenerated answers.

Target features are computed online (the default) for each batch. AdamW with linear warm-up and cosine
decay, gradient clipping, optional bf16 autocast. Every `save_every` steps the trainable weights, the
optimizer and all random states go to one file, written atomically, so a killed run resumes exactly.
With `torchrun --nproc-per-node N` each process takes its share of every global batch and gradients
are averaged (gloo on CPU); the global batch and its anchors do not depend on the number of processes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tqdm import tqdm

from ..draft.checkpoint import draft_config, load_drafter, save_drafter
from ..draft.draft_vocab import DRAFT_VOCAB_FILE, TrainingVocab, answer_vocab, load_draft_vocab, save_draft_vocab
from ..draft.dspark_model import DSparkModel
from ..draft.eagle3_model import Eagle3Model, eagle3_config
from ..target.loading import load_target
from ..target.model import TargetModel
from .anchors import sample_anchors
from .config import TrainConfig
from .feature_cache import FeatureCache
from .features import target_features
from .forward import forward_for
from .train_state import (STATE_FILE, compare_settings, describe, file_sha256, read_state, save_state, say,
                          trim_log)




def stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 2


def load_sequences(path: str, max_len: int) -> list[dict]:
    """Records of a regenerated JSONL, cut to max_len tokens; a repeated id (two runs appending to one file)
    counts once. A malformed line is a one-line ValueError naming the file and line."""
    recs, seen = [], set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rid, prompt, answer = r["id"], list(r["prompt_ids"]), list(r["answer_ids"])
                if not prompt or not all(isinstance(t, int) for t in prompt + answer):
                    raise ValueError("prompt_ids and answer_ids must be lists of token ids, the prompt not empty")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                reason = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"{path}:{n} is not a regenerated record ({reason})") from None
            if rid in seen:
                continue
            seen.add(rid)
            ids = (prompt + answer)[:max_len]
            recs.append({"id": rid, "ids": ids, "start": len(prompt) - 1,
                         "answer": ids[len(prompt):]})  # the answer tokens trained on
    if not recs:
        raise ValueError(f"no training records in {path}")
    return recs


DRAFTER_TYPES = ("dspark", "dflash", "eagle3", "mtp")
SMALL_INIT_NORM_SCALE = 0.2


def new_drafter(cfg: TrainConfig, target_config: dict) -> DSparkModel | Eagle3Model:
    if cfg.init not in ("target", "small"):
        raise ValueError(f"init must be target or small, got {cfg.init!r}")
    if cfg.drafter_type not in DRAFTER_TYPES:
        raise ValueError(f"drafter_type must be one of {DRAFTER_TYPES}, got {cfg.drafter_type!r}")
    if cfg.drafter_type in ("eagle3", "mtp"):
        return Eagle3Model(eagle3_config(target_config, block_size=cfg.block_size, mtp=cfg.drafter_type == "mtp",
                                         num_anchors=cfg.num_anchors))
    rank = 0 if cfg.drafter_type == "dflash" else cfg.markov_rank
    return DSparkModel(draft_config(target_config, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                    markov_rank=rank, markov_head_type=cfg.markov_head_type,
                                    confidence=cfg.confidence, num_anchors=cfg.num_anchors))


def init_from_target(model: DSparkModel | Eagle3Model, target: TargetModel) -> None:
    """Start the backbone from the target's last layers (same shapes; Eagle3's 2d-wide q/k/v read the
    average of both halves), the sequential head at zero bias and the confidence head at 0.5; this is
    what makes short CPU training runs useful."""
    def copy_in(linear, w):
        linear.weight.copy_(w if linear.in_features == w.shape[1] else torch.cat([w, w], 1) / 2)

    with torch.no_grad():
        n = len(model.layers)
        for mine, theirs in zip(model.layers, target.layers[-n:]):
            H, KVH, hd = theirs.self_attn.num_heads, theirs.self_attn.num_kv_heads, theirs.self_attn.head_dim
            q, k, v = theirs.self_attn.qkv_proj.weight.split([H * hd, KVH * hd, KVH * hd])
            copy_in(mine.self_attn.q_proj, q)
            copy_in(mine.self_attn.k_proj, k)
            copy_in(mine.self_attn.v_proj, v)
            mine.self_attn.o_proj.weight.copy_(theirs.self_attn.o_proj.weight)
            gate, up = theirs.mlp.gate_up_proj.weight.chunk(2)
            mine.mlp.gate_proj.weight.copy_(gate)
            mine.mlp.up_proj.weight.copy_(up)
            mine.mlp.down_proj.weight.copy_(theirs.mlp.down_proj.weight)
            mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
            if hasattr(mine, "hidden_norm"):
                mine.hidden_norm.weight.copy_(theirs.input_layernorm.weight)
        model.norm.weight.copy_(target.norm.weight)
        if getattr(model, "markov_head", None) is not None:
            torch.nn.init.normal_(model.markov_head.markov_w1.weight, std=0.02)
            torch.nn.init.zeros_(model.markov_head.markov_w2.weight)
        if model.confidence_head is not None:
            torch.nn.init.zeros_(model.confidence_head.proj.weight)
            torch.nn.init.zeros_(model.confidence_head.proj.bias)


def init_small(model: DSparkModel | Eagle3Model, target: TargetModel) -> None:
    """Every trainable matrix N(0, 0.02), norms at one, biases zero, the final norm a fifth of the target's;
    the sequential head at zero bias and the confidence head at 0.5 as in init_from_target."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.zeros_(p)
        # the shared LM head expects the target's final-norm scale; a fifth of it keeps the first drafts
        # near uniform instead of confidently wrong (the hidden state starts as the block token's embedding,
        # which the full scale turns into a peaked, saturated softmax that trains slowly)
        model.norm.weight.copy_(target.norm.weight * SMALL_INIT_NORM_SCALE)
        if getattr(model, "markov_head", None) is not None:
            torch.nn.init.zeros_(model.markov_head.markov_w2.weight)
        if model.confidence_head is not None:
            torch.nn.init.zeros_(model.confidence_head.proj.weight)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the {self.world} processes")
        self.out = Path(cfg.out)
        self.state_path = self.out / STATE_FILE
        saved = read_state(self.state_path) if self.state_path.is_file() else None
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.target_dtype]
        self.target, _, target_folder = load_target(cfg.target, dtype)
        self.fingerprint = {"target": Path(str(target_folder)).name, "data_sha256": file_sha256(cfg.data)}
        self.changes = self._check_resume(saved) if saved else []
        self.records = load_sequences(cfg.data, cfg.max_len)
        self.cache = None
        if saved and "weights" not in saved:
            say(f"train: {self.state_path} holds no weights (an older checkpoint): they are read from "
                f"{self.out / 'model.safetensors'}, unchecked")
            self.model = load_drafter(self.out, self.target, dtype=torch.float32)
        else:
            torch.manual_seed(cfg.seed)
            self.model = new_drafter(cfg, self.target.config.to_dict())
            (init_from_target if cfg.init == "target" else init_small)(self.model, self.target)
            self.model.float()
            # the frozen embedding and LM head are the target's own tensors, never copies
            self.model.embed_tokens.weight, self.model.lm_head.weight = (
                self.target.embed_tokens.weight, self.target.lm_head.weight)
            if saved:
                self.model.load_state_dict(saved["weights"], strict=False)
        self.records = self._with_room(self.records)
        n_eval = min(cfg.eval_sequences, len(self.records) // 10)
        self.train_recs, self.eval_recs = self.records[: len(self.records) - n_eval], self.records[len(self.records) - n_eval:]
        if cfg.feature_cache:
            if cfg.target_dtype != "bf16":
                raise ValueError("the feature cache holds bf16 target features: train with target_dtype bf16")
            self.cache = FeatureCache(cfg.feature_cache, self.model.target_layer_ids, cfg.max_len)
        trained_vocab = self.trained_vocab_size()
        if saved and bool(cfg.draft_vocab) != bool(trained_vocab):
            raise ValueError(f"{self.out} trains over a draft vocabulary: resume it with --draft-vocab {trained_vocab}"
                             if trained_vocab else
                             f"{self.out} was trained over the whole vocabulary: resume it without --draft-vocab")
        self.vocab = self._training_vocab(resumed=saved is not None) if cfg.draft_vocab else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.step = 0
        if saved:
            self._resume(saved)

    def _check_resume(self, saved: dict) -> list[dict]:
        """Compare the saved settings with these (module docstring of train_state.py); the changes allowed."""
        fingerprint = saved.get("fingerprint")  # the target's folder name and the data's hash (older runs: none)
        refused, changed = compare_settings({**saved["config"], **(fingerprint or {})},
                                            {**asdict(self.cfg), **(self.fingerprint if fingerprint else {})})
        if fingerprint:  # the data is compared by content: the same file elsewhere is no change
            changed = [c for c in changed if c["field"] != "data"]
        if refused:
            raise ValueError(f"{self.out} was trained with another drafter ({'; '.join(refused)}); these cannot change "
                             "on resume: train in a new folder")
        if changed and not self.cfg.allow_changes:
            raise ValueError(f"{self.out} was trained with other settings ({describe(changed)}); resume with the same "
                             "ones, or pass --allow-changes 1 to change them (recorded in the checkpoint)")
        return [{**c, "step": saved["step"]} for c in changed]

    def _with_room(self, records: list[dict]) -> list[dict]:
        """The records with room for at least one block after the prompt within max_len; the others would give
        steps without a loss, so they are left out, with a message."""
        block = self.model.block_size
        kept = [r for r in records if len(r["ids"]) - 1 - block >= r["start"]]
        if len(kept) < len(records) and self.rank == 0:
            say(f"train: {len(records) - len(kept)} of {len(records)} records leave no room for a block of {block} "
                f"within --max-len {self.cfg.max_len} (a prompt too long or an answer too short): left out")
        if not kept:
            raise ValueError(f"no record of {self.cfg.data} leaves room for a block within --max-len {self.cfg.max_len}")
        return kept

    def _training_vocab(self, resumed: bool) -> TrainingVocab:
        """The draft vocabulary of the training answers (held-out ones excluded), written beside the weights at
        the start, so that inference drafts from the tokens trained on; a resumed run reads it back."""
        path = self.out / DRAFT_VOCAB_FILE
        if resumed:
            ids = load_draft_vocab(self.out, self.model.c.vocab_size, honour_options=False).tolist()
            if len(ids) != self.cfg.draft_vocab:
                raise ValueError(f"{path} holds {len(ids)} tokens, not --draft-vocab {self.cfg.draft_vocab}")
        else:
            ids = answer_vocab([r["answer"] for r in self.train_recs], self.cfg.draft_vocab, self.model.config)
            if self.rank == 0:
                self.out.mkdir(parents=True, exist_ok=True)
                save_draft_vocab(self.out, ids, {"data": str(self.cfg.data), "answers": len(self.train_recs),
                                                 "trained": True})
        return TrainingVocab(torch.tensor(ids), self.model.lm_head)

    def trained_vocab_size(self) -> int:
        """The size of the draft vocabulary this run's folder was trained over (0: none; a vocabulary given to it by
        `dspark draft-vocab` is for inference only)."""
        path = self.out / DRAFT_VOCAB_FILE
        record = json.loads(path.read_text()) if path.is_file() else {}
        return len(record["ids"]) if record.get("trained") else 0

    # ---- schedule and data order ----------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        frac = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def batch_records(self, step: int) -> list[dict]:
        """The global batch of a step: a seeded permutation per epoch, so order survives a restart."""
        n, bs = len(self.train_recs), self.cfg.batch_size
        out = []
        for i in range(step * bs, (step + 1) * bs):
            epoch, pos = divmod(i, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch))
            out.append(self.train_recs[int(perm[pos])])
        return out

    # ---- one step ---------------------------------------------------------------------------------
    def losses(self, recs: list[dict], step: int):
        ids = [r["ids"] for r in recs]
        if self.cache is not None and all(r["id"] in self.cache for r in recs):
            feats = self.cache.features(recs)
        else:
            feats = target_features(self.target, ids, self.model.target_layer_ids)
        L = max(feats.lengths)
        tokens = torch.zeros(len(ids), L, dtype=torch.long)
        for i, s in enumerate(ids):
            tokens[i, :len(s)] = torch.tensor(s)
        # anchors depend on the step and the record, not on the process that draws them
        gens = [torch.Generator().manual_seed(stable_seed(self.cfg.seed, step, r["id"])) for r in recs]
        anchors = sample_anchors(feats.lengths, [r["start"] for r in recs], self.cfg.num_anchors,
                                 self.model.block_size, gens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.autocast_bf16):
            out = forward_for(self.model)(self.model, self.target, tokens, feats, anchors, vocab=self.vocab)
        return out.loss()

    def train_step(self) -> dict:
        recs = self.batch_records(self.step)
        share = len(recs) // self.world
        parts = self.losses(recs[self.rank * share:(self.rank + 1) * share], self.step)
        self.opt.zero_grad(set_to_none=True)
        loss = parts.total
        if self.world > 1:  # each process averaged over its own blocks: reweight to the global average
            blocks = parts.blocks.float()
            total = blocks.clone()
            dist.all_reduce(total)
            loss = loss * (blocks * self.world / total.clamp(min=1))
        loss.backward()
        if self.world > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= self.world
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.opt.step()
        self.step += 1
        loss, ce, tv, conf, tau = self.global_figures(parts)
        return {"step": self.step, "loss": loss, "ce": ce, "tv": tv, "conf": conf, "tau_est": tau,
                "grad_norm": float(gnorm), "lr": self.lr_at(self.step - 1)}

    def global_figures(self, parts) -> list[float]:
        """Loss terms and τ over the whole global batch: each process's averages weighted by its blocks."""
        figures = torch.stack([parts.total, parts.ce, parts.tv, parts.conf, parts.tau]).detach().float()
        if self.world == 1:
            return figures.tolist()
        blocks = parts.blocks.float().reshape(1)
        summed = torch.cat([figures * blocks, blocks])
        dist.all_reduce(summed)
        return (summed[:-1] / summed[-1].clamp(min=1)).tolist()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out expected acceptance length (1 + Σ_k Π_{i<=k} c*_i) and per-position acceptance."""
        if not self.eval_recs:
            return {}
        taus, accepts = [], []
        for i in range(0, len(self.eval_recs), 4):
            parts = self.losses(self.eval_recs[i:i + 4], -1 - i)
            taus.append(parts.tau.item())
            accepts.append(parts.accept)
        return {"eval_tau_est": sum(taus) / len(taus),
                "eval_accept": [round(x, 4) for x in torch.stack(accepts).mean(0).tolist()]}

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self):
        """The state (one atomic file, train_state.py), then the drafter folder's view of it."""
        if self.rank != 0:
            return
        weights = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        save_state(self.state_path, {"step": self.step, "weights": weights, "opt": self.opt.state_dict(),
                                     "config": asdict(self.cfg), "fingerprint": self.fingerprint,
                                     "changes": self.changes,
                                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}})
        save_drafter(self.model, self.out)

    def _resume(self, state: dict):
        self.step = state["step"]
        self.opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        new, self.changes = self.changes, state.get("changes", []) + self.changes
        if self.rank != 0:
            return
        if "weights" in state and not self._view_matches(state["weights"]):
            say(f"train: {self.out / 'model.safetensors'} was not step {self.step}'s (a kill between the checkpoint's "
                "writes): rewritten from the training state")
            save_drafter(self.model, self.out)
        dropped = trim_log(self.out, self.step)
        changes = f"; settings changed: {describe(new)}" if new else ""
        say(f"train: resumed {self.out} from step {self.step}"
            + (f" ({dropped} log rows after it dropped)" if dropped else "") + changes)

    def _view_matches(self, weights: dict) -> bool:
        view = self.out / "model.safetensors"
        try:
            saved = load_file(view)
        except Exception:  # absent or torn: rewritten from the state
            return False
        return saved.keys() == weights.keys() and all(torch.equal(saved[k], w) for k, w in weights.items())

    def log(self, row: dict):
        if self.rank == 0:
            with open(self.out / "train_log.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def fit(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        start, row = time.time(), {}
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", disable=self.rank != 0)
        while self.step < self.cfg.steps:
            row = self.train_step()
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tv=f"{row['tv']:.3f}", tau=f"{row['tau_est']:.2f}")
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                row.update(self.evaluate())
            self.log(row)
            timeout = self.cfg.max_minutes is not None and time.time() - start > 60 * self.cfg.max_minutes
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps or timeout:
                self.save()
            if timeout:
                break
        bar.close()
        return row


def main_train(cfg: TrainConfig) -> dict:
    torch_dist = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if torch_dist and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        return Trainer(cfg).fit()
    finally:
        if torch_dist and dist.is_initialized():
            dist.destroy_process_group()
