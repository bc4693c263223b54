"""The small interface every inference engine implements (vLLM, transformers).

A runner submits requests as capacity frees up and polls for finished ones: there is no batch
barrier, so an engine with continuous batching (vLLM) stays saturated. Engines never see Kafka.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from vlmstream.queued_engine import (ENGINE_DEAD, ENGINE_STOP, EngineDeadError, QueuedEngine,  # noqa: F401
                                     drop_queued)

if TYPE_CHECKING:
    from vlmstream.config import InferSettings


# Most glibc malloc arenas in a process whose engine computes on the CPU. glibc gives each thread that allocates an
# arena of its own, up to 8 per core, and each keeps what its thread freed: long runs on the CPU grew by hundreds of
# MB, less with 2 (benchmarks/soak_run.py). MALLOC_ARENA_MAX exported by the user wins.
CPU_MALLOC_ARENAS = 2


def limit_cpu_use(settings: InferSettings, device: str) -> None:
    """infer.cpu_threads (0 leaves torch's own choice) and at most CPU_MALLOC_ARENAS malloc arenas, for an engine
    that computes on the CPU."""
    if device != "cpu":
        return
    if settings.cpu_threads > 0:
        import torch

        torch.set_num_threads(settings.cpu_threads)
    if not os.environ.get("MALLOC_ARENA_MAX"):
        cap_malloc_arenas(CPU_MALLOC_ARENAS)


M_ARENA_MAX = -8  # glibc's malloc.h


def cap_malloc_arenas(arenas: int) -> None:
    """At most ``arenas`` glibc malloc arenas from now on in this process, as MALLOC_ARENA_MAX would at its start
    (arenas made before stay). Nothing where the C library has no mallopt (not glibc): the cap only saves memory."""
    try:
        ctypes.CDLL(None).mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas))
    except (OSError, AttributeError):
        pass


class EngineCannotLoadModel(RuntimeError):
    """The engine cannot load the configured model: raised at start, naming infer.model, before any record is read
    (never a dead letter per image)."""


@dataclass(frozen=True)
class InferenceRequest:
    request_id: str
    image: np.ndarray  # H x W x 3 uint8 RGB, at the exact model input size (multiples of the family's factor)
    grid_thw: tuple[int, int, int]  # (1, H/patch, W/patch); for the generic path an estimate (generic.py)
    prompt: str
    max_new_tokens: int
    want_embedding: bool = False


@dataclass(frozen=True)
class InferenceOutput:
    request_id: str
    text: str
    prompt_tokens: int
    output_tokens: int
    visual_tokens: int
    embedding: np.ndarray | None = None  # (out_hidden_size,) float16: the main merger's tokens, mean-pooled
    parsed_json: object | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class InferenceFailure:
    """A per-request failure (the engine is fine): the runner retries it or dead-letters it."""

    request_id: str
    error_kind: str
    detail: str
    retriable: bool = True


class Engine(Protocol):
    name: str  # "vllm" or "transformers"
    model_id: str
    revision: str | None
    mode: str | None  # "embeds" / "pixels" for vLLM; None otherwise
    # Sequences the engine runs at once (vLLM: max_num_seqs): the runner sizes its in-flight window by it.
    batch_size: int
    # Tokens the engine computes per step (vLLM: max_num_batched_tokens); None for an engine without such a bound.
    step_tokens: int | None

    def submit(self, requests: Sequence[InferenceRequest]) -> None:
        """Queue requests; returns at once."""

    def poll(self, timeout_s: float) -> list[InferenceOutput | InferenceFailure]:
        """Finished requests (in any order), waiting up to timeout_s for at least one. Raises EngineDeadError."""

    def pending(self) -> int:
        """Requests submitted and not yet returned by poll."""

    def close(self) -> None:
        """Stop the engine and release the device; no process may be left behind."""
