"""Pick and build the inference engine the settings ask for."""

from __future__ import annotations

import logging
from pathlib import Path

from consumers.infer.engine import Engine
from vlmstream.config import InferSettings
from vlmstream.vllm_process import load_format, vllm_usable

log = logging.getLogger(__name__)


def make_engine(settings: InferSettings, model_path: str | Path | None = None, *, ignore_eos: bool = False,
                engine_kwargs: dict | None = None) -> Engine:
    """``engine="auto"``: vLLM when it is installed and CUDA is available, else transformers (on CUDA when
    available, else CPU). An empty model means the built-in tiny model (written on first use). ``ignore_eos`` and
    ``engine_kwargs`` (vLLM's engine arguments) are for benchmarks only (``VllmEngine`` says why)."""
    if not model_path:
        model_path = settings.model
    if not model_path:
        from consumers.infer.tiny_model import default_tiny_model_dir

        model_path = default_tiny_model_dir()
    kind = settings.engine
    if kind == "auto":
        kind = "vllm" if vllm_usable() else "transformers"
        log.info("engine=auto -> %s", kind)
    if kind == "vllm":
        from consumers.infer.vllm_engine import VllmEngine

        return VllmEngine(model_path, settings, mode=settings.mode, load_format=load_format(model_path),
                          engine_kwargs=engine_kwargs, ignore_eos=ignore_eos)
    from vlmstream.models.registry import family_of

    family = family_of(model_path)
    if not family.exact_size:  # the generic path: the model's own processor
        from consumers.infer.processor_engine import ProcessorEngine

        return ProcessorEngine(model_path, settings, family, ignore_eos=ignore_eos)
    from consumers.infer.transformers_engine import TransformersEngine

    return TransformersEngine(model_path, settings, ignore_eos=ignore_eos)
