"""An optional on-disk cache of target features, so that training epochs after the first (and every drafter
trained on the same data) skip the target forward. `dspark features` writes it; `dspark train
--feature-cache DIR` reads it.

Layout: shard-NNNNN.safetensors files of up to `shard_size` records, each record as "<id>/features"
([n, m·d], the outputs of the cached target layers, concatenated in `layers` order) and "<id>/hidden" ([n, d],
final-normed hidden states), in bf16; index.json maps record ids to shards and names the layers, the
target and max_len. Shards are written atomically, so an interrupted build resumes where it stopped.
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


def build_cache(target: TargetModel, records: list[dict], layers: list[int], out: str | Path, *,
                batch_size: int = 8, shard_size: int = 256, target_name: str = "", max_len: int = 0,
                progress: bool = True) -> Path:
    """records: [{"id", "ids"}] (as load_sequences returns them)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else {
        "layers": list(layers), "target": target_name, "max_len": max_len, "records": {}}
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
        self.columns = [index["layers"].index(layer) for layer in layer_ids]
        self.files = {}

    def __contains__(self, record_id: str) -> bool:
        return record_id in self.records

    def get(self, record_id: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [n, m·d] of the requested layers, hidden [n, d]), bf16 as the bf16 target gives them."""
        name = self.records[record_id]
        if name not in self.files:
            self.files[name] = safe_open(str(self.folder / name), framework="pt")
        f = self.files[name]
        feats = f.get_tensor(f"{record_id}/features")[:n]
        hidden = f.get_tensor(f"{record_id}/hidden")[:n]
        d = hidden.shape[1]
        feats = feats.view(n, -1, d)[:, self.columns].reshape(n, -1)
        return feats, hidden

    def features(self, records: list[dict]) -> SequenceFeatures:
        """The batch's SequenceFeatures, padded like target_features pads them."""
        parts = [self.get(r["id"], len(r["ids"])) for r in records]
        lengths = [len(r["ids"]) for r in records]
        L = max(lengths)
        feats = parts[0][0].new_zeros(len(records), L, parts[0][0].shape[1])
        hidden = parts[0][1].new_zeros(len(records), L, parts[0][1].shape[1])
        for i, (f, h) in enumerate(parts):
            feats[i, :lengths[i]], hidden[i, :lengths[i]] = f, h
        return SequenceFeatures(feats, hidden, lengths)
