"""What a condense engine takes and gives (``factory`` picks one). Engines never see Kafka.

Both engines are ``QueuedEngine``s (``vlmstream/queued_engine.py``): the runner submits documents as capacity frees
and polls finished ones in any order, no batch barrier. vLLM batches continuously; the transformers engine decodes
what is queued (up to ``condense.batch_size``) together, never waiting for a full batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence



@dataclass(frozen=True)
class CondenseRequest:
    request_id: str
    prompt_ids: list[int]  # the whole prompt, chat template included
    max_new_tokens: int


@dataclass(frozen=True)
class CondenseOutput:
    request_id: str
    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" (the answer ended), "length" (cut at the token bound)
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CondenseFailure:
    """One document failed (the engine is fine): the runner retries it or dead-letters it."""

    request_id: str
    error_kind: str
    detail: str
    retriable: bool = True


class CondenseEngine(Protocol):
    name: str  # "vllm" or "transformers"
    model_id: str
    revision: str | None
    batch_size: int  # documents it runs at once: the runner sizes its in-flight window by it
    tokenizer: Any  # the model's tokenizer: the runner builds prompts with it

    def submit(self, requests: Sequence[CondenseRequest]) -> None: ...

    def poll(self, timeout_s: float) -> list[CondenseOutput | CondenseFailure]: ...

    def pending(self) -> int: ...

    def close(self) -> None: ...


def is_multimodal(model_path: str | Path) -> bool:
    """Whether a local checkpoint is a vision-language one (its language model then runs text only)."""
    config = Path(model_path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False
