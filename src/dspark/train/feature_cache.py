"""An optional on-disk cache of target features, so that training epochs after the first (and every drafter
trained on the same data) skip the target forward. `dspark features` writes it; `dspark train
--feature-cache DIR` reads it.

Layout: shard-NNNNN.safetensors files of up to `shard_size` records, each record as "<id>/features"
([n, m·d], the outputs of the cached target layers, concatenated in `layers` order) and "<id>/hidden" ([n, d],
final-normed hidden states), in bf16, and "<id>/lse" ([n] float32, the log-normaliser of the target's logits
there at temperature 1: training over a draft vocabulary then needs only the LM head's rows of that vocabulary);
index.json maps record ids to shards and names the layers, the target and max_len. Shards are written atomically,
so an interrupted build resumes where it stopped. A cache begun before the log-normaliser was stored goes on
without it (its index has no "lse" entry) and training computes it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..target.model import TargetModel
from .features import SequenceFeatures, target_features

INDEX = "index.json"
LSE_ROWS = 256  # positions whose logits are formed at a time for the log-normaliser


def log_normaliser(target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
    """logsumexp of the target's logits [n, V] (its own dtype, then float32) at hidden [n, d], row chunk by chunk."""
    return torch.cat([target.logits(hidden[i:i + LSE_ROWS], dtype=None).float().logsumexp(-1)
                      for i in range(0, hidden.shape[0], LSE_ROWS)])


def build_cache(target: TargetModel, records: list[dict], layers: list[int], out: str | Path, *,
                batch_size: int = 8, shard_size: int = 256, target_name: str = "", max_len: int = 0,
                progress: bool = True) -> Path:
    """records: [{"id", "ids"}] (as load_sequences returns them)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else {
        "layers": list(layers), "target": target_name, "max_len": max_len, "lse": True, "records": {}}
    if index["layers"] != list(layers) or index["max_len"] != max_len:
        raise ValueError(f"{out} caches layers {index['layers']} (max_len {index['max_len']}); asked for {layers} "
                         f"({max_len}): use another folder")
    shards = [records[i:i + shard_size] for i in range(0, len(records), shard_size)]
    bar = tqdm(total=len(records), desc="features", disable=not progress)
    for s, shard in enumerate(shards):
        name = f"shard-{s:05d}.safetensors"
        if all(index["records"].get(r["id"]) == name for r in shard):
            bar.update(len(shard))
            continue
        tensors = {}
        for i in range(0, len(shard), batch_size):
            batch = shard[i:i + batch_size]
            feats = target_features(target, [r["ids"] for r in batch], tuple(layers))
            for j, r in enumerate(batch):
                n = feats.lengths[j]
                tensors[f"{r['id']}/features"] = feats.features[j, :n].to(torch.bfloat16).contiguous()
                tensors[f"{r['id']}/hidden"] = feats.hidden[j, :n].to(torch.bfloat16).contiguous()
                if index.get("lse"):
                    tensors[f"{r['id']}/lse"] = log_normaliser(target, tensors[f"{r['id']}/hidden"])
            bar.update(len(batch))
        tmp = out / f".{name}.part"
        save_file(tensors, tmp)
        os.replace(tmp, out / name)
        index["records"].update({r["id"]: name for r in shard})
        tmp_index = out / f".{INDEX}.part"
        tmp_index.write_text(json.dumps(index))
        os.replace(tmp_index, index_path)
    bar.close()
    return out


class FeatureCache:
    def __init__(self, folder: str | Path, layer_ids: tuple[int, ...], max_len: int):
        self.folder = Path(folder)
        if not (self.folder / INDEX).is_file():
            raise FileNotFoundError(f"no feature cache at {self.folder} ({INDEX} missing): run `dspark features`")
        index = json.loads((self.folder / INDEX).read_text())
        missing = [layer for layer in layer_ids if layer not in index["layers"]]
        if missing:
            raise ValueError(f"the feature cache at {folder} has layers {index['layers']}, not {missing}")
        if index["max_len"] < max_len:
            raise ValueError(f"the feature cache holds sequences cut at {index['max_len']} tokens, training asks {max_len}")
        self.records = index["records"]
        self.has_lse = bool(index.get("lse"))
        self.columns = [index["layers"].index(layer) for layer in layer_ids]
        self.files = {}

    def __contains__(self, record_id: str) -> bool:
        return record_id in self.records

    def get(self, record_id: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(features [n, m·d] of the requested layers, hidden [n, d], bf16 as the bf16 target gives them, and the
        log-normaliser [n] or None)."""
        name = self.records[record_id]
        if name not in self.files:
            self.files[name] = safe_open(str(self.folder / name), framework="pt")
        f = self.files[name]
        feats = f.get_tensor(f"{record_id}/features")[:n]
        hidden = f.get_tensor(f"{record_id}/hidden")[:n]
        d = hidden.shape[1]
        feats = feats.view(n, -1, d)[:, self.columns].reshape(n, -1)
        return feats, hidden, f.get_tensor(f"{record_id}/lse")[:n] if self.has_lse else None

    def features(self, records: list[dict]) -> SequenceFeatures:
        """The batch's SequenceFeatures, padded like target_features pads them."""
        parts = [self.get(r["id"], len(r["ids"])) for r in records]
        lengths = [len(r["ids"]) for r in records]
        L = max(lengths)
        feats = parts[0][0].new_zeros(len(records), L, parts[0][0].shape[1])
        hidden = parts[0][1].new_zeros(len(records), L, parts[0][1].shape[1])
        lse = torch.zeros(len(records), L) if self.has_lse else None
        for i, (f, h, z) in enumerate(parts):
            feats[i, :lengths[i]], hidden[i, :lengths[i]] = f, h
            if lse is not None:
                lse[i, :lengths[i]] = z
        return SequenceFeatures(feats, hidden, lengths, lse)
