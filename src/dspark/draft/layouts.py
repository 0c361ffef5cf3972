"""The checkpoint layouts a drafter folder can have, and the translation between them (docs/checkpoint_format.md).

- `deepspec`, our own and the released one: architectures ["Qwen3DSparkModel"], the drafter fields at the top level
  of config.json beside the target's, and (as exported) every weight, the target's embedding and LM head included.
- `specforge`, SpecForge's `DSparkDraftModel`: architectures ["DSparkDraftModel"], the drafter fields nested under
  `dflash_config` (with `projector_type` "dspark" and an `attention_mode`), `num_target_layers` and `block_size` at the
  top level, and no embedding or LM head (the trainer takes the target's).
The weight names are the same in both. A folder in either layout loads (`load_drafter` reads `dflash_config`)."""
from __future__ import annotations

LAYOUTS = ("deepspec", "specforge")
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
SPECFORGE_ARCHITECTURE = "DSparkDraftModel"
# drafter fields that SpecForge reads from dflash_config (the others stay at the top level in both layouts)
NESTED = ("target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
          "confidence_head_with_markov")


def is_specforge(config: dict) -> bool:
    return isinstance(config.get("dflash_config"), dict)


def to_specforge(config: dict) -> dict:
    """A deepspec config.json as SpecForge writes it."""
    out = {k: v for k, v in config.items() if k not in NESTED and k not in ("num_anchors", "torch_dtype")}
    nested = {k: config[k] for k in NESTED if k in config}
    grouped = config.get("num_key_value_heads", config["num_attention_heads"]) < config["num_attention_heads"]
    nested.update(projector_type="dspark", attention_mode="gqa" if grouped else "mha")
    out.update(architectures=[SPECFORGE_ARCHITECTURE], dflash_config=nested,
               head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
               dtype=config.get("torch_dtype", "bfloat16"))
    return out


def from_specforge(config: dict, default_mask_token: int) -> dict:
    """A SpecForge config.json as deepspec fields (the mask id, which SpecForge's inference never reads and may leave
    unset, defaults to `default_mask_token`)."""
    nested = config["dflash_config"]
    projector = nested.get("projector_type", "dspark")
    if projector != "dspark":
        raise ValueError(f"a SpecForge drafter with projector_type {projector!r} is not a DSpark/DFlash drafter")
    out = {k: v for k, v in config.items() if k not in ("dflash_config", "dtype")}
    out.update({k: nested[k] for k in NESTED if nested.get(k) is not None})
    out.setdefault("mask_token_id", default_mask_token)
    out["architectures"] = [DEEPSPEC_ARCHITECTURE]
    if "dtype" in config:
        out["torch_dtype"] = config["dtype"]
    return out
