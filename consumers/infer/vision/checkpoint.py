"""Loading the tower alone from a checkpoint folder (for vLLM's embeds mode, where vLLM holds the language model), and
the family a tower belongs to."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vlmstream.models.family import ModelFamily


def family_of_tower(visual: torch.nn.Module) -> ModelFamily:
    """The family whose patch and merge sizes a tower's config has (for an encoder built without one)."""
    from vlmstream.models.registry import families

    for family in families().values():
        if any(tower.model_class.endswith(f":{type(visual).__name__}") for tower in family.towers.values()):
            return family
    config = visual.config
    patch, merge = int(config.patch_size), int(config.spatial_merge_size)
    for family in families().values():
        if (family.patch_size, family.merge_size) == (patch, merge) and family.towers:
            return family
    raise ValueError(f"no model family has {patch} px patches merged {merge} x {merge}")


VISION_PREFIXES = ("visual.", "model.visual.")


def _import(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def checkpoint_tower(model_path: str | Path):
    """(family, tower spec, raw vision_config) of a checkpoint folder, from its config.json."""
    from vlmstream.models.registry import family_of

    family = family_of(model_path)
    config = json.loads((Path(model_path) / "config.json").read_text())
    return family, family.tower_for(config.get("model_type")), config["vision_config"]


def vision_config_from(model_path: str | Path):
    _, tower, raw = checkpoint_tower(model_path)
    return _import(tower.config_class)(**{k: v for k, v in raw.items() if k != "model_type"})


def vision_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """The tower's weights from a checkpoint's safetensors (keys ``visual.*`` in the released layout,
    ``model.visual.*`` in transformers 5's), prefix removed; empty when the folder has no weights."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                for prefix in VISION_PREFIXES:
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = f.get_tensor(key)
    return state


def load_vision_tower(model_path: str | Path, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[torch.nn.Module, bool]:
    """(tower, has_real_weights). A folder without weights (vLLM ``load_format="dummy"``) gets a seeded
    random tower: same compute, so throughput figures hold; embeddings are then meaningless. The tower's class
    is the family's for the checkpoint's model_type (vlmstream/models/)."""
    _, spec, _ = checkpoint_tower(model_path)
    tower_class = _import(spec.model_class)
    config = vision_config_from(model_path)
    config._attn_implementation = "sdpa"
    state = vision_state_dict(model_path)
    # A seeded random tower is drawn on the CPU and then moved: a GPU's generator draws other numbers from the same
    # seed, and the engine's tower (built on its GPU) must be the one a CPU reference builds for the same folder.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device if state else "cpu"):
            tower = tower_class._from_config(config, dtype=dtype).eval()
    if not state:
        tower = tower.to(device)
    if state:
        missing, unexpected = tower.load_state_dict(state, strict=False)
        # The rotary inverse frequencies are computed, not stored; anything else missing is a wrong checkpoint.
        missing = [k for k in missing if "inv_freq" not in k]
        if missing or unexpected:
            raise RuntimeError(f"vision weights in {model_path} do not fit the tower: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    return tower, bool(state)
