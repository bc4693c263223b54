"""What a forward of the tower gives back, per image, and its way to the host: each image's ``image_embeds`` (the
main merger's tokens, then any DeepStack levels' on the feature axis) and its embedding, the mean of the main
merger's part (``mean_pool``). Copies off the GPU are queued without waiting for it (``to_host_later``,
``TowerPass``): on a GPU shared with the language model every wait can last the other context's turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from consumers.infer.vision.pixels import page_locked


@dataclass
class EncodedImage:
    # (visual tokens, image_embeds width) on the encoder's device: the main merger's output, then any DeepStack levels
    tokens: torch.Tensor
    grid_thw: tuple[int, int, int]
    # Columns of ``tokens`` that are the main merger's output (out_hidden_size).
    embedding_width: int | None = None

    def mean_pooled(self) -> np.ndarray:
        return mean_pool(self.tokens, self.embedding_width)


def mean_pool(tokens: torch.Tensor, width: int | None = None) -> np.ndarray:
    """The embedding published on the embeddings topic: the mean over the image's visual tokens of the main merger's
    output (the first ``width`` columns; DeepStack levels after them are left out), accumulated in float32, stored
    as float16."""
    return tokens[:, :width].float().mean(0).to(torch.float16).cpu().numpy()


def mean_pooled(tokens: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """``mean_pool`` of each image's tokens as one (images, width) float16 tensor, on the tokens' device."""
    return torch.stack([t[:, :width].float().mean(0) for t in tokens]).to(torch.float16)


def mean_pool_each(tokens: Sequence[torch.Tensor], width: int | None = None) -> list[np.ndarray]:
    """``mean_pool`` of each image's tokens, brought to the host in one copy. Each copy from the GPU waits for it,
    and on a GPU shared with the language model every wait can last the other context's turn: one per batch, not
    one per image."""
    if not tokens:
        return []
    return list(mean_pooled(tokens, width).cpu().numpy())


def to_host_later(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Each tensor as a CPU tensor with storage of its own, the copies started without waiting for the GPU: they
    are readable once the returned event has passed (None: CPU tensors, copied already)."""
    if not tensors or not tensors[0].is_cuda:
        return [t.clone(memory_format=torch.contiguous_format) for t in tensors], None
    # One page-locked tensor per input, each filled by the GPU's DMA: no byte passes through this thread's core (a
    # pageable copy is the driver's memcpy through a staging buffer, and a copy of a batch split into clones is a
    # CPU memcpy of every byte: 117 MB per 12.8 MP Qwen2.5-VL image, 32 MB per 1 MP Qwen3-VL one with its
    # DeepStack levels). torch's caching host allocator reuses the pinned blocks.
    hosts = []
    for t in tensors:
        host = page_locked(lambda t=t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        hosts.append(torch.empty(t.shape, dtype=t.dtype) if host is None else host)
    for host, t in zip(hosts, tensors):
        host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return hosts, event


def to_host_each(tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each image's tokens as a CPU tensor with storage of its own (``to_host_later``), after one wait. Own storage
    because vLLM's front end serialises each tensor with its whole storage: a view into the batch would ship the
    batch once per image."""
    hosts, copied = to_host_later(tokens)
    if copied is not None:
        copied.synchronize()
    return hosts


class TowerPass:
    """One forward's outputs on their way to the host: launched by ``VisionEncoder.launch``, read by ``wait``.

    The launch queues the tower's kernels and the copies to the host and returns without waiting for the GPU, so
    the thread that feeds vLLM can prepare the next forward (patchify, index tensors, launches) while the GPU runs
    this one. On a GPU shared with vLLM's engine every wait can last the other context's turn; a thread that waited
    for each forward before preparing the next left the tower's queue empty for that host work.
    Only host tensors and an event are kept: the GPU tensors return to the caching allocator at once, which is safe
    because every later use of that memory is queued on the same stream after these copies."""

    def __init__(self, tokens: list[torch.Tensor | None], pooled: torch.Tensor | None, wanted: list[int],
                 copied: torch.cuda.Event | None):
        self._tokens, self._pooled, self._wanted, self._copied = tokens, pooled, wanted, copied

    def wait(self) -> tuple[list[torch.Tensor | None], list[np.ndarray | None]]:
        """(each image's ``image_embeds`` on the host or None where not asked for, each image's embedding as
        ``mean_pool`` makes it or None where not asked for)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        embeddings: list[np.ndarray | None] = [None] * len(self._tokens)
        for row, i in zip(self._pooled.numpy() if self._pooled is not None else (), self._wanted):
            embeddings[i] = row
        return self._tokens, embeddings
