"""Which condense engine the settings ask for: vLLM on a CUDA machine that has it, else transformers."""

from __future__ import annotations

import logging
from pathlib import Path

from consumers.condense.engine import CondenseEngine
from consumers.condense.stage import AnswerSchema
from vlmstream.config import CondenseSettings
from vlmstream.vllm_process import load_format, vllm_usable

log = logging.getLogger(__name__)


def make_engine(settings: CondenseSettings, model_path: str | Path, answer_schema: AnswerSchema) -> CondenseEngine:
    """``engine="auto"``: vLLM when it is installed and CUDA is available, else transformers. The model path is
    resolved by the caller (``condense.model``, else ``infer.model``, else the tiny model)."""
    kind = settings.engine
    if kind == "auto":
        kind = "vllm" if vllm_usable() else "transformers"
        log.info("condense engine=auto -> %s", kind)
    if kind == "vllm":
        from consumers.condense.vllm_engine import VllmCondenseEngine

        return VllmCondenseEngine(model_path, settings, answer_schema, load_format=load_format(model_path))
    from consumers.condense.transformers_engine import TransformersCondenseEngine

    return TransformersCondenseEngine(model_path, settings, answer_schema)
