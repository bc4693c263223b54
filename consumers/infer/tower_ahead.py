"""Our tower in vLLM's engine process, run ahead of the engine's step (``infer.tower_ahead``).

With ``infer.engine_tower`` vLLM's model runner calls our tower inside its step, for the images of the requests the
scheduler has just admitted, and the language model's forward waits for it: tower and language model take turns on
the GPU. Here the tower runs earlier, on a stream of its own, for images that are still waiting: vLLM's input thread
hands each request's pixel rows over as it prepares the request (``offer``, from ``EngineCore.preprocess_add_request``),
a thread of ours encodes them in arrival order while the engine's step runs, and when the step reaches those images
it takes the tokens already made (``take``) instead of running the tower. The GPU then runs the tower's kernels beside
the language model's wherever the language model leaves it room (its decode steps, the gaps between its kernels and
between steps), not after it.

Images are found by the tag in their rows (``pixel_rows``): with ``infer.tower_ahead`` every image's rows carry one,
and its lowest bit says whether the consumer also wants the image's embedding (``pixel_rows.keeps_embedding``). What
the thread has made waits on the GPU until taken, bounded by ``infer.tower_ahead_tokens`` merged tokens (the
thread stops while that many wait); an image the step asks for before the thread reached it is encoded in the step as
without this module. What is never taken (an aborted request's image) is dropped once later images have been
taken past it (``keep_behind``). One lock keeps the thread and the step from running the encoder at once: its
compiled code and its caches are not shared between threads.

Nothing here imports vLLM; ``engine_tower`` installs the hooks in vLLM and calls ``offer`` and ``take``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from consumers.infer import pixel_rows

log = logging.getLogger(__name__)


@dataclass
class _Offered:
    seq: int
    rows: torch.Tensor  # (visual tokens, row_width + TAG_BYTES) uint8, on the host, as vLLM's request holds it
    grid: tuple[int, int, int]
    tokens: int  # merged tokens of the image's output


@dataclass
class _Encoded:
    seq: int
    output: torch.Tensor  # the image's image_embeds, made on the ahead stream
    ready: object  # the CUDA event after it (None on the CPU)
    tokens: int


@dataclass
class AheadTotals:
    offered: int = 0
    encoded: int = 0  # by the thread
    forwards: int = 0  # the thread's
    taken: int = 0  # by the step, made by the thread
    missed: int = 0  # asked for before the thread had made them: encoded in the step
    dropped: int = 0  # made or queued, never taken
    failed: int = 0  # the thread's forwards that raised (their images encoded in the step)


class AheadEncoder:
    """Encodes offered images ahead of the engine's step, on a stream of its own, and hands them over by tag.

    ``budget_tokens``: most merged tokens made and not yet taken (their GPU memory: tokens x the tower's output width
    x 2 bytes; 65,536 tokens of Qwen2.5-VL-7B are 470 MB). ``keep_behind``: an image made or queued is dropped once
    images offered this many after it have been taken. ``max_queued``: most images waiting for the thread (their
    rows are the requests' own memory); the oldest go first. ``max_patches``: most patches per forward of the
    thread (one image always fits): the step may ask for an image of the forward the thread is running, and then
    waits for the whole forward, so it is kept short (16 images at 0.2 MP, three at 1 MP). The encoder arrives with
    ``attach`` (the engine builds it on its first image batch); images offered before that are not kept, and the
    step encodes them."""

    def __init__(self, budget_tokens: int = 65536, keep_behind: int = 4096, max_queued: int = 16384,
                 max_patches: int = 16384):
        if budget_tokens < 1:
            raise ValueError("infer.tower_ahead_tokens must be at least 1")
        self.budget_tokens, self.keep_behind, self.max_queued = budget_tokens, keep_behind, max_queued
        self.max_patches = max_patches
        self.encoder = None
        self.encoder_lock = threading.Lock()  # the thread's launches and the step's own encoding, one at a time
        self.totals = AheadTotals()
        self._cond = threading.Condition()
        self._queued: collections.OrderedDict[int, _Offered] = collections.OrderedDict()  # tag -> waiting image
        self._running: dict[int, _Offered] = {}  # tag -> being encoded by the thread now
        self._made: dict[int, _Encoded] = {}  # tag -> made, waiting to be taken
        self._held = 0  # tokens running or made
        self._taken_up_to = -1  # the highest offer seq taken or encoded in the step
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._keep_embeddings = None
        self._clock = None
        self._stream = None

    # ------------------------------------------------------------------------------------------- engine side

    def attach(self, encoder, keep_embeddings=None, clock=None) -> None:
        """Start the thread with ``encoder`` (a ``VisionEncoder``). ``keep_embeddings(tags, outputs)``: keeps the
        embeddings of the images whose tag asks for one (engine_tower's tap); ``clock``: a ``TowerClock`` for the
        thread's forwards. Attaching again changes nothing."""
        with self._cond:
            if self._thread is not None:
                return
            self.encoder, self._keep_embeddings, self._clock = encoder, keep_embeddings, clock
            if encoder.device.type == "cuda":
                # Lowest priority: where the two compete the language model's kernels go first.
                self._stream = torch.cuda.Stream(device=encoder.device, priority=0)
            self._thread = threading.Thread(target=self._run, name="vlmstream-tower-ahead", daemon=True)
            self._thread.start()

    def offer(self, rows: torch.Tensor, grid_thw) -> bool:
        """One image's pixel rows (tagged) as a request brings them; False (nothing kept) before ``attach`` and for
        rows that are not one tagged image of the grid."""
        if self.encoder is None:
            return False
        tag, grid = pixel_rows.tag_of(rows, grid_thw, self.encoder.family)
        if tag is None:
            return False
        with self._cond:
            self._queued[tag] = _Offered(next(self._seq), rows, grid, rows.shape[0])
            self.totals.offered += 1
            while len(self._queued) > self.max_queued:
                self._queued.popitem(last=False)
                self.totals.dropped += 1
            self._cond.notify_all()
        return True

    def take(self, tags: list[int]) -> list[torch.Tensor | None]:
        """Each tag's image_embeds made ahead, ready to use on the current stream, or None where the step must encode
        it (never offered, or not reached yet: it leaves the queue)."""
        with self._cond:
            while any(tag in self._running for tag in tags):
                self._cond.wait()
            found: list[_Encoded | None] = []
            for tag in tags:
                made = self._made.pop(tag, None)
                if made is not None:
                    self._held -= made.tokens
                    self.totals.taken += 1
                    self._taken_up_to = max(self._taken_up_to, made.seq)
                else:
                    offered = self._queued.pop(tag, None)
                    if offered is not None:
                        self._taken_up_to = max(self._taken_up_to, offered.seq)
                    self.totals.missed += 1
                found.append(made)
            self._drop_behind()
            self._cond.notify_all()
        if self._stream is None:
            return [made.output if made else None for made in found]
        current = torch.cuda.current_stream(self.encoder.device)
        outputs = []
        for made in found:
            if made is None:
                outputs.append(None)
                continue
            current.wait_event(made.ready)
            # The memory was the ahead stream's: the allocator must not give it back out until the step's kernels,
            # queued on this stream, are done with it.
            made.output.record_stream(current)
            outputs.append(made.output)
        return outputs

    def report(self) -> dict:
        with self._cond:
            totals = vars(self.totals).copy()
            return {**totals, "queued": len(self._queued), "made_waiting": len(self._made), "held_tokens": self._held,
                    "budget_tokens": self.budget_tokens, "running": self._thread is not None}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------- the thread

    def _drop_behind(self) -> None:
        """Drop what was offered ``keep_behind`` or more before the latest image taken (under the lock)."""
        limit = self._taken_up_to - self.keep_behind
        if limit < 0:
            return
        for tag in [t for t, o in self._queued.items() if o.seq <= limit]:
            del self._queued[tag]
            self.totals.dropped += 1
        for tag in [t for t, m in self._made.items() if m.seq <= limit]:
            self._held -= self._made.pop(tag).tokens
            self.totals.dropped += 1

    def _next_group(self) -> list[tuple[int, _Offered]]:
        """The images at the queue's head that fit the budget and one forward (under the lock); empty: wait."""
        group, patches = [], 0
        limit = min(self.max_patches, self.encoder.max_patches_per_call)
        unit = self.encoder.family.merge_size ** 2
        held = self._held
        for tag, offered in self._queued.items():
            image_patches = offered.tokens * unit
            fits_budget = held + offered.tokens <= self.budget_tokens or (held == 0 and not group)
            if not fits_budget or (group and patches + image_patches > limit):
                break
            group.append((tag, offered))
            patches += image_patches
            held += offered.tokens
        return group

    def _run(self) -> None:
        if self._stream is not None:
            # A new thread's current CUDA device is the first one; the Triton kernels launch on the current device.
            torch.cuda.set_device(self.encoder.device)
        while True:
            with self._cond:
                group = []
                while not self._closed and not (group := self._next_group()):
                    self._cond.wait()
                if self._closed:
                    return
                for tag, offered in group:
                    del self._queued[tag]
                    self._running[tag] = offered
                    self._held += offered.tokens
            try:
                made = self._encode(group)
            except Exception as exc:  # noqa: BLE001 - the step encodes these images itself; the engine goes on
                log.warning("vlmstream tower ahead: a forward of %d images failed (%s: %s); the engine's step encodes "
                            "them", len(group), type(exc).__name__, str(exc)[:300])
                made = None
            with self._cond:
                for (tag, offered), output in zip(group, made or [None] * len(group)):
                    del self._running[tag]
                    if output is None:
                        self._held -= offered.tokens
                        continue
                    self._made[tag] = _Encoded(offered.seq, output[0], output[1], offered.tokens)
                    self.totals.encoded += 1
                if made is None:
                    self.totals.failed += 1
                else:
                    self.totals.forwards += 1
                self._drop_behind()
                self._cond.notify_all()

    @torch.inference_mode()
    def _encode(self, group: list[tuple[int, _Offered]]) -> list[tuple[torch.Tensor, object]]:
        from consumers.infer.vision import to_device

        encoder = self.encoder
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with self.encoder_lock, stream:
            # Staged in page-locked memory: a copy from the request's pageable memory would first wait for
            # everything queued on this stream, and the thread could not queue the next forward meanwhile.
            images = [pixel_rows.unpack(to_device(o.rows, encoder.device), torch.tensor([o.grid]), encoder.family)[0]
                      for _, o in group]
            started = self._clock.start() if self._clock is not None and self._stream is not None else None
            outputs = encoder.encode_images(images)
            if started is not None:
                self._clock.stop(started, len(outputs))
            if self._keep_embeddings is not None:
                wanted = [i for i, (tag, _) in enumerate(group) if pixel_rows.keeps_embedding(tag)]
                if wanted:
                    self._keep_embeddings([group[i][0] for i in wanted], [outputs[i] for i in wanted])
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._stream)
        return [(output, ready) for output in outputs]
