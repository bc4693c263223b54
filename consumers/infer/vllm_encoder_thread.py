"""The vLLM engine's encoder thread: it takes the submitted images, runs our vision tower on them in this process
where that is its place (embeds mode with the tower not in vLLM's engine process; embeddings in pixels mode), and
hands each image to vLLM as soon as its tower pass is done: no batch barrier. It keeps the next tower pass queued on
the GPU while it waits for one (``_encode_loop``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from consumers.infer.engine import ENGINE_DEAD as _DEAD
from consumers.infer.engine import InferenceFailure, InferenceRequest
from consumers.infer.vision.encoder import groups_by_patches
from consumers.infer.vision.outputs import TowerPass
from consumers.infer.vision.pixels import request_problem
from vlmstream.models.family import ModelFamily

log = logging.getLogger(__name__)

# Most images per forward of the tower in this process (where vLLM's engine does not take it, and for embeddings in
# pixels mode); each forward is also bounded to 65,536 patches (VisionEncoder.max_patches_per_call), which binds
# first for images over 2,048 patches (about 0.4 MP). vLLM's scheduler decides the batches of the tower in its engine.
VISION_BATCH_IMAGES = 32


@dataclasses.dataclass
class _TowerWork:
    """Requests whose tower pass is queued on the GPU (``TowerPass``), and when it was queued."""
    items: list[tuple[InferenceRequest, float]]
    tower_pass: TowerPass
    started: float


def _patches(item: tuple[InferenceRequest, float]) -> int:
    _, grid_h, grid_w = item[0].grid_thw
    return grid_h * grid_w


def expected_image_embeds_width(hf_config) -> int:
    """The ``image_embeds`` width vLLM's model takes, from the config it loaded: the vision merger's
    ``out_hidden_size``, times one plus its DeepStack levels (Qwen3-VL's ``deepstack_visual_indexes``)."""
    vision = hf_config.vision_config
    vision = vision.to_dict() if hasattr(vision, "to_dict") else dict(vision)
    return ModelFamily.image_embeds_width(vision)


def image_embeds_problem(tokens, grid_thw: tuple[int, int, int], family: ModelFamily, width: int) -> str | None:
    """Why ``tokens`` are not the image_embeds vLLM expects for an image of this grid, or None."""
    rows = family.visual_tokens(grid_thw)
    if tuple(tokens.shape) != (rows, width):
        return (f"vision tower output {tuple(tokens.shape)} is not the ({rows}, {width}) image_embeds the model takes "
                f"for grid {tuple(grid_thw)}")
    return None


class EncoderThread:
    """VllmEngine's encoder thread (``_encode_loop``); ``_dispatch`` (the engine's) hands the images to vLLM."""

    def _encode_loop(self) -> None:
        # Tower passes queued on the GPU and not yet waited for, oldest first. A pass is waited for only once the
        # next one is queued behind it, or once nothing more is waiting in the inbox: so the GPU always has tower
        # work queued while this thread prepares the next forward or hands finished images to vLLM.
        in_flight: collections.deque[_TowerWork] = collections.deque()
        try:
            stopping = False
            while not stopping or in_flight:
                batch: list = []
                if not stopping:
                    batch, stopping = self._next_batch(VISION_BATCH_IMAGES, block=not in_flight)
                for work in self._launch_batch(batch):
                    in_flight.append(work)
                    while len(in_flight) > 1:
                        self._finish(in_flight.popleft())
                if not batch and in_flight:
                    self._finish(in_flight.popleft())
        except BaseException as exc:
            log.exception("vLLM encoder thread died")
            self._dead = exc
            self._outbox.put(_DEAD)

    def _launch_batch(self, batch: list[tuple[InferenceRequest, float]]):
        """Dispatches at once what needs no tower here; yields a ``_TowerWork`` per forward as it is queued."""
        valid = []
        for request, submitted in batch:
            problem = request_problem(request.image, request.grid_thw, self.family)
            if problem:
                self._outbox.put(InferenceFailure(request.request_id, "invalid_request", problem, retriable=False))
            else:
                valid.append((request, submitted))
        need_tower = [(r, s) for r, s in valid if self._embeds_here() or (r.want_embedding and self.encoder)]
        tower_ids = {id(r) for r, _ in need_tower}
        self._dispatch([(r, s) for r, s in valid if id(r) not in tower_ids], {})
        for group in groups_by_patches(need_tower, _patches, self.encoder.max_patches_per_call if need_tower else 1):
            # Each group goes to vLLM as soon as it is encoded: the language model starts on the first images
            # while the tower works on the next.
            yield from self._launch_splitting(group)

    def _launch_splitting(self, items: list[tuple[InferenceRequest, float]]):
        torch = self._torch
        started = time.perf_counter()
        try:
            with torch.cuda.stream(self._stream):
                tower_pass = self.encoder.launch([r.image for r, _ in items], self._embeds_here(),
                                                 [i for i, (r, _) in enumerate(items) if r.want_embedding])
        except torch.cuda.OutOfMemoryError as exc:  # raised while queuing: allocations are made on the host's side
            torch.cuda.empty_cache()
            if len(items) == 1:
                request = items[0][0]
                self._outbox.put(InferenceFailure(request.request_id, "out_of_memory", f"vision tower: {exc}",
                                                  retriable=False))
                return
            half = len(items) // 2
            log.warning("vision tower out of memory on %d images; retrying as %d + %d", len(items), half,
                        len(items) - half)
            yield from self._launch_splitting(items[:half])
            yield from self._launch_splitting(items[half:])
            return
        yield _TowerWork(items, tower_pass, started)

    def _finish(self, work: _TowerWork) -> None:
        """Waits for one tower pass and hands its images to vLLM."""
        tokens, embeddings = work.tower_pass.wait()
        finished = time.perf_counter()
        # The pass's own span: from its launch, or from the previous pass's end when it was queued behind that one,
        # so that the spans of passes queued back to back add up to the wall time, not more.
        encode_ms = (finished - max(work.started, self._last_pass_finished)) * 1e3
        self._last_pass_finished = finished
        timings = {"encode_ms": encode_ms, "encode_batch_images": float(len(work.items))}
        encoded = {}
        for (request, _), t, e in zip(work.items, tokens, embeddings):
            # Checked here, not left to vLLM: a wrong shape fails inside its engine process, taking every request.
            problem = t is not None and image_embeds_problem(t, request.grid_thw, self.family, self.image_embeds_width)
            encoded[request.request_id] = (InferenceFailure(request.request_id, "invalid_request", problem,
                                                            retriable=False)
                                           if problem else (t, e, dict(timings)))
        self._dispatch(work.items, encoded)
