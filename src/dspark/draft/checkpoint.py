"""Drafter checkpoints (docs/checkpoint_format.md): config.json (the target's config plus drafter fields) and
model.safetensors, in the released DeepSpec layout or SpecForge's (layouts.py). Training writes only the trainable
weights, the frozen embedding and LM head coming from the target at load time; `export_frozen=True` (what `dspark
export` does by default) writes them too, as engines that load every weight from the file expect. Extras
(calibration, training state) live in separate files beside them."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .dspark_model import DSparkModel, build_target_layer_ids  # noqa: F401 (re-exported)
from .eagle3_model import EAGLE3_ARCHITECTURE, Eagle3Model
from .layouts import LAYOUTS, from_specforge, is_specforge, to_specforge

FROZEN = ("embed_tokens.weight", "lm_head.weight")
UMASK = os.umask(0o022)  # read once, at import (setting it is the only way to read it)
os.umask(UMASK)


def draft_config(target_config: dict, *, num_layers: int = 1, block_size: int = 7, markov_rank: int = 64,
                 markov_head_type: str = "vanilla", confidence: bool = True, num_features: int = 3,
                 mask_token_id: int | None = None, num_anchors: int = 64, architecture: str = "Qwen3DSparkModel") -> dict:
    """A drafter config.json: the target's config with the released drafter fields."""
    cfg = {k: v for k, v in target_config.items() if k not in ("quantization_config", "_name_or_path")}
    n_target = target_config["num_hidden_layers"]
    cfg.update(architectures=[architecture], num_hidden_layers=num_layers, num_target_layers=n_target,
               target_layer_ids=build_target_layer_ids(n_target, num_features), block_size=block_size,
               mask_token_id=mask_token_id if mask_token_id is not None else default_mask_token(target_config),
               num_anchors=num_anchors, markov_rank=markov_rank, markov_head_type=markov_head_type,
               enable_confidence_head=confidence, confidence_head_with_markov=confidence and markov_rank > 0,
               tie_word_embeddings=False, layer_types=["full_attention"] * num_layers)
    cfg.setdefault("head_dim", target_config["hidden_size"] // target_config["num_attention_heads"])
    return cfg


def default_mask_token(target_config: dict) -> int:
    """Qwen3's reserved mask id, else a rarely used special id (SmolLM2: 16, <empty_output>)."""
    if target_config.get("vocab_size", 0) > 151669 and target_config.get("model_type") == "qwen3":
        return 151669
    return 16


def atomic_write(path: Path, write):
    """write(tmp) then rename over path, with a new file's usual permissions (mkstemp's are 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_drafter(model: DSparkModel | Eagle3Model, folder: str | Path, *, export_frozen: bool = False,
                 dtype: torch.dtype | None = None, layout: str = "deepspec") -> Path:
    """Write config.json + model.safetensors (each file atomically) in a layout of layouts.py; the specforge layout
    never holds the frozen weights."""
    if model.draft_ids is not None:
        raise ValueError("this drafter's heads were cut to its draft vocabulary (inference only); save the full model")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {layout!r}: give one of {', '.join(LAYOUTS)}")
    if layout == "specforge" and is_eagle3(model.config):
        raise ValueError("the specforge layout is for DSpark and DFlash drafters; Eagle3-style ones export as deepspec")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keep_frozen = export_frozen and layout == "deepspec"
    state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()
             if keep_frozen or k not in FROZEN}
    config = dict(model.config, torch_dtype=str(dtype or model.dtype).removeprefix("torch."))
    if layout == "specforge":
        config = to_specforge(config)
    atomic_write(folder / "model.safetensors", lambda p: save_file(state, p, metadata={"format": "pt"}))
    atomic_write(folder / "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2)))
    return folder


def check_compatible(config: dict, target_config) -> None:
    for field in ("vocab_size", "hidden_size"):
        mine, theirs = config.get(field), getattr(target_config, field)
        if mine != theirs:
            raise ValueError(f"this drafter was trained for a different target: its {field} is {mine}, the "
                             f"target's is {theirs}")
    n = config.get("num_target_layers", target_config.num_hidden_layers)
    if n != target_config.num_hidden_layers or max(config["target_layer_ids"]) >= target_config.num_hidden_layers:
        raise ValueError(f"this drafter reads target layers {config['target_layer_ids']} of a {n}-layer target; "
                         f"the target has {target_config.num_hidden_layers} layers")


def is_eagle3(config: dict) -> bool:
    return EAGLE3_ARCHITECTURE in config.get("architectures", [])


CONFIG_TYPES = {"target_layer_ids": list, "block_size": int, "mask_token_id": int, "markov_rank": int,
                "markov_head_type": str, "enable_confidence_head": bool, "confidence_head_with_markov": bool,
                "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int, "num_attention_heads": int,
                "num_key_value_heads": int, "vocab_size": int, "head_dim": int}


def read_config(folder: Path) -> dict:
    """A drafter's config.json (SpecForge's layout read too), its drafter fields present and of the right types;
    anything else is a one-line error naming the file."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no drafter at {folder} (config.json missing)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a drafter config (a JSON object)")
    if is_specforge(config):
        config = from_specforge(config, default_mask_token(config))
    required = ("target_layer_ids", "block_size") if is_eagle3(config) else ("target_layer_ids", "block_size",
                                                                              "mask_token_id")
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"{path} is not a DSpark/DFlash/Eagle3 drafter config (missing {missing})")
    config.setdefault("markov_rank", 0)
    config.setdefault("markov_head_type", "vanilla")
    config.setdefault("enable_confidence_head", False)
    config.setdefault("confidence_head_with_markov", False)
    for field, kind in CONFIG_TYPES.items():
        value = config.get(field)
        wrong = value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool)))
        if wrong or (field == "target_layer_ids" and not all(type(i) is int for i in value)):
            raise ValueError(f"{path}: {field} must be {'a list of ints' if kind is list else kind.__name__}, "
                             f"got {value!r}")
    return config


def load_drafter(folder: str | Path, target=None, dtype: torch.dtype | None = None) -> DSparkModel | Eagle3Model:
    """Load a drafter folder (DSpark, DFlash, or Eagle3-style by `architectures`); with a target
    (TargetModel), check it fits and share its embedding and LM head."""
    folder = Path(folder)
    config = read_config(folder)
    if target is not None:
        check_compatible(config, target.config)
    try:
        state = load_file(folder / "model.safetensors")
    except FileNotFoundError:
        raise FileNotFoundError(f"no drafter weights at {folder / 'model.safetensors'}") from None
    except Exception as exc:  # a torn or foreign file
        raise ValueError(f"{folder / 'model.safetensors'} is not a readable safetensors file ({exc}); export or "
                         "copy the drafter again") from None
    dtype = dtype or (target.dtype if target is not None else next(iter(state.values())).dtype)
    with torch.device("meta"):
        model = Eagle3Model(config) if is_eagle3(config) else DSparkModel(config)
    if target is not None:
        state.update({"embed_tokens.weight": target.embed_tokens.weight, "lm_head.weight": target.lm_head.weight})
    absent = [k for k in FROZEN if k not in state]
    if absent:
        raise ValueError(f"{folder} has no {absent}: pass the target to load the frozen weights from it")
    # copy=True: safetensors hands out views at unaligned offsets of one buffer, on which CPU matmuls take
    # other kernels and round differently; fresh tensors make a loaded drafter compute bit-identically
    model.load_state_dict({k: v if k in FROZEN and target is not None else v.to(dtype, copy=True)
                           for k, v in state.items()}, strict=True, assign=True)
    model.rotary = type(model.rotary)(model.rotary_config)
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model
