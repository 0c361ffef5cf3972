"""The settings of one training run (`dspark train`'s flags are made from these fields)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    data: str  # regenerated JSONL: {"id", "prompt_ids", "answer_ids", ...}
    out: str  # drafter folder (config.json, model.safetensors, train_state.pt, train_log.jsonl)
    target: str | None = None
    target_dtype: str = "bf16"
    drafter_type: str = "dspark"  # dspark | dflash (no sequential head) | eagle3 | mtp (MTP-1)
    num_layers: int = 1
    block_size: int = 7
    markov_rank: int = 64
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence: bool = True
    feature_cache: str | None = None  # folder from `dspark features`; None: target features online
    draft_vocab: int = 0  # train over the N most frequent answer tokens (draft_vocab.py); 0: the whole vocabulary
    init: str = "target"  # target: backbone from the target's last layers | small: N(0, 0.02) weights
    num_anchors: int = 32
    max_len: int = 512
    batch_size: int = 4  # sequences per global step (split across processes)
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    autocast_bf16: bool = False
    seed: int = 0
    save_every: int = 50
    eval_every: int = 100
    eval_sequences: int = 16  # held out from the end of the data file
    max_minutes: float | None = None  # stop (after saving) when this much wall time has passed
    allow_changes: bool = False  # on resume, accept changed training settings (recorded in the checkpoint)
    extra: dict = field(default_factory=dict)
