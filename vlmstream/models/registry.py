"""Which ``ModelFamily`` a checkpoint belongs to, from its ``config.json``, with the pixel limits its image
processor settings set (``processor_config.json``'s ``image_processor``, else ``preprocessor_config.json``).
Families are the ``FAMILY`` of each module in this package."""

from __future__ import annotations

import importlib
import json
import pkgutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import vlmstream.models as _package
from vlmstream.models.family import ModelFamily

DEFAULT_FAMILY = "qwen2_vl"


class UnknownModelFamily(ValueError):
    """No family here describes this model; the message names what the checkpoint says it is."""


@lru_cache(maxsize=1)
def families() -> dict[str, ModelFamily]:
    """Every family, by name: the ``FAMILY`` of each module of ``vlmstream.models``."""
    found: dict[str, ModelFamily] = {}
    for module in pkgutil.iter_modules(_package.__path__):
        family = getattr(importlib.import_module(f"{_package.__name__}.{module.name}"), "FAMILY", None)
        if isinstance(family, ModelFamily):
            found[family.name] = family
    return found


def family_named(name: str) -> ModelFamily:
    try:
        return families()[name]
    except KeyError:
        raise UnknownModelFamily(f"unknown model family {name!r}; known: {', '.join(sorted(families()))}") from None


def family_for_config(config: dict[str, Any]) -> ModelFamily:
    """The family of a checkpoint's parsed ``config.json``: by ``model_type``, else by ``architectures``."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    for family in families().values():
        if model_type in family.model_types:
            return family
    for family in families().values():
        if any(name in family.architectures for name in architectures):
            return family
    raise UnknownModelFamily(
        f"no model family in vlmstream/models for model_type {model_type!r} (architectures {architectures}); "
        f"known model types: {', '.join(t for f in families().values() for t in f.model_types)}")


def image_processor_config(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's image processor settings where transformers (and so vLLM) takes them from: the
    ``image_processor`` entry of ``processor_config.json`` (as transformers 5 saves a processor), else
    ``preprocessor_config.json``; None without either."""
    processor_file = folder / "processor_config.json"
    if processor_file.is_file():
        nested = json.loads(processor_file.read_text()).get("image_processor")
        if isinstance(nested, dict):
            return nested
    legacy_file = folder / "preprocessor_config.json"
    return json.loads(legacy_file.read_text()) if legacy_file.is_file() else None


def family_of(checkpoint: str | Path) -> ModelFamily:
    """The family of the checkpoint folder ``checkpoint``, its pixel limits those of the folder's image processor
    settings (``image_processor_config``: ``min_pixels``/``max_pixels``, or transformers 5's ``size`` with
    ``shortest_edge``/``longest_edge``); without them, the image processor's own defaults.
    A model no family describes but with a ``vision_config`` and image processor settings gets the generic path
    (``generic.generic_family``); anything else raises ``UnknownModelFamily``."""
    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        raise UnknownModelFamily(f"{folder} has no config.json: the model (infer.model, decode.model) must be a local "
                                 "checkpoint folder for its family to be known (download it first, e.g. "
                                 "huggingface-cli download)")
    config = json.loads((folder / "config.json").read_text())
    processor = image_processor_config(folder)
    try:
        family = family_for_config(config)
    except UnknownModelFamily:
        # An image-text model of no family here: the generic path, when the checkpoint has a vision part and an
        # image processor to do its model-specific rest.
        if "vision_config" not in config:
            raise
        if processor is None:
            raise UnknownModelFamily(
                f"{folder} is an image-text model of no family here (model_type {config.get('model_type')!r}), and "
                f"the generic path needs its image processor's settings, which the folder lacks: add the "
                f"checkpoint's preprocessor_config.json (or processor_config.json) to it") from None
        from vlmstream.models.generic import generic_family

        return generic_family(config, processor)
    min_pixels, max_pixels = family.min_pixels, family.processor_max_pixels
    if processor is not None:
        size = processor.get("size") or {}
        min_pixels = processor.get("min_pixels") or size.get("shortest_edge") or min_pixels
        max_pixels = processor.get("max_pixels") or size.get("longest_edge") or max_pixels
    return family.with_pixel_limits(int(min_pixels), int(max_pixels))


def deepstack_levels(checkpoint: str | Path) -> int:
    """How many DeepStack levels (Qwen3-VL's ``deepstack_visual_indexes``) a checkpoint's tower adds to its image
    embeddings; 0 for a model without them or without a readable ``config.json``."""
    config_file = Path(checkpoint) / "config.json"
    if not config_file.is_file():
        return 0
    vision = json.loads(config_file.read_text()).get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes") or ())
