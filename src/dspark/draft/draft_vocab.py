"""A draft vocabulary, as Eagle3's released drafters have: the drafter's LM head (and the Markov head's W2) keep
only the rows of the tokens most frequent in the training answers, so a drafting call's largest product, its
softmax and its top-p and sampling run over those columns instead of the whole vocabulary. Drafts are then never
outside it: q is the request's sampling distribution computed over its logits there (at temperature 1 without top-k
or top-p, the whole-vocabulary distribution renormalised over them; greedy, the argmax among them) and zero
elsewhere, still exactly what the drafts were sampled from, so verification stays lossless (the target itself still
emits any token). For SmolLM2-135M-Instruct's 49,152 tokens the 8,192 most frequent hold 98.2% of the 714,855
tokens of the committed training answers. Sizes are multiples of 16, the row tile of the 4-bit kernel that a q4_1
target's drafter head runs on.

The draft vocabulary is an extra beside a drafter's weights (`draft_vocab.json`, sorted token ids), applied at load
for inference (Options.draft_vocab=False, `--no-draft-vocab`, turns it off). A drafter trained with one (`dspark train --draft-vocab N`,
TrainingVocab) learns q over exactly those tokens; one trained over the whole vocabulary can be given one afterwards
(`dspark draft-vocab`).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch

from .. import options
from ..kernels.upcast import ManyRowsLinear

DRAFT_VOCAB_FILE = "draft_vocab.json"


def most_frequent(answers, size: int, vocab_size: int, always=()) -> list[int]:
    """`size` token ids, sorted: the `always` ids (the end-of-turn id, so that a draft can end an answer), then the
    most frequent over the answers (sequences of ids), ties to the smaller id, then (when fewer distinct tokens
    occur) unseen ids from the smallest."""
    if size % 16 or not 16 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary's size must be a multiple of 16 from 16 to {vocab_size}, got {size}")
    counts = Counter(t for answer in answers for t in answer)
    if any(not 0 <= t < vocab_size for t in (*counts, *always)):
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    chosen = dict.fromkeys([*always, *ranked, *range(vocab_size)])  # ordered, distinct
    return sorted(list(chosen)[:size])


def answer_vocab(answers, size: int, config: dict) -> list[int]:
    """most_frequent over the answers with the target's end-of-turn ids always in (so a draft can end an answer)."""
    eos = config.get("eos_token_id")
    always = [t for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
    return most_frequent(answers, size, config["vocab_size"], always)


def save_draft_vocab(folder: str | Path, ids: list[int], meta: dict) -> Path:
    path = Path(folder) / DRAFT_VOCAB_FILE
    tmp = path.with_suffix(".json.part")
    tmp.write_text(json.dumps({**meta, "size": len(ids), "ids": ids}))
    os.replace(tmp, path)
    return path


def load_draft_vocab(folder: str | Path, vocab_size: int, honour_options: bool = True) -> torch.Tensor | None:
    """The sorted ids of the folder's draft vocabulary, or None (no file, or Options.draft_vocab off unless
    honour_options is False)."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if (honour_options and not options.current().draft_vocab) or not path.is_file():
        return None
    ids = torch.tensor(json.loads(path.read_text())["ids"], dtype=torch.long)
    if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{path}: ids must be sorted, distinct and below the vocabulary size {vocab_size}")
    return ids


def rows_of(linear: torch.nn.Linear, ids: torch.Tensor) -> ManyRowsLinear:
    """A frozen copy of the linear layer with only the output rows `ids`."""
    out = ManyRowsLinear(linear.in_features, len(ids), bias=linear.bias is not None,
                         dtype=linear.weight.dtype)
    out.weight = torch.nn.Parameter(linear.weight.detach()[ids].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.detach()[ids].clone(), requires_grad=False)
    return out


def restrict(model, ids: torch.Tensor) -> None:
    """Draft from the tokens `ids` only (inference): the LM head and the Markov head's W2 keep their rows.
    The model can no longer be saved or trained (`draft_ids` marks it)."""
    model.lm_head = rows_of(model.lm_head, ids)
    markov = getattr(model, "markov_head", None)
    if markov is not None:
        markov.markov_w2 = rows_of(markov.markov_w2, ids)
    model.draft_ids = ids


def token_ids(drawn: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Indices drawn from a q over the draft vocabulary -> token ids (the indices themselves when ids is None)."""
    return drawn if ids is None else ids[drawn]


def widen(q: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """q [..., |ids|] over the draft vocabulary -> [..., V], zero outside it (q itself when ids is None)."""
    if ids is None:
        return q
    out = q.new_zeros(*q.shape[:-1], vocab_size)
    out[..., ids] = q
    return out


class TrainingVocab:
    """Training over a draft vocabulary: the drafter's logits U and the Markov head's W2 over its columns only, and
    the target's logits there with the whole vocabulary's log-normaliser (losses.RowTerms), so the LM-head
    product and the loss's element-wise work shrink by V / |ids|. What is trained is what inference drafts from:
    q over the same tokens. Labels become indices into the vocabulary, -1 for a token outside it."""

    LSE_ROWS = 64  # rows of the target's logits made float32 at a time for the log-normaliser

    def __init__(self, ids: torch.Tensor, lm_head: torch.nn.Linear):
        self.ids = ids
        self.head = rows_of(lm_head, ids)
        self.index = torch.full((lm_head.out_features,), -1, dtype=torch.long)
        self.index[ids] = torch.arange(len(ids))

    def columns(self, t: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
        """The target's logits t [N, V] -> (t over the vocabulary [N, |ids|], labels as indices, lse [N] of t / T)."""
        lse = torch.cat([(t[i:i + self.LSE_ROWS].float() / temperature).logsumexp(-1)
                         for i in range(0, t.shape[0], self.LSE_ROWS)])
        return t[:, self.ids], self.index[labels], lse

    def rows(self, w2: torch.Tensor) -> torch.Tensor:
        """The Markov head's W2 [V, r] -> its rows of the vocabulary (gradients reach only those)."""
        return w2[self.ids]
