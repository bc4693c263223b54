"""Our vision tower inside vLLM's engine process, in embeds mode for a Qwen family.

Run in the inference consumer's process, our tower would take a second CUDA context beside vLLM's, which the GPU
time-slices against it, and each image's image_embeds would cross to vLLM's engine process through host memory
(117 MB for a 12.8 MP Qwen2.5-VL image). This module puts it in vLLM's engine process instead: vLLM imports it in its
worker as a worker extension (``worker_extension_cls``), before it builds the model, and the import routes each Qwen
model class's image inputs through ``VisionEncoder``, in one CUDA context. Those inputs are the decoded image itself,
its uint8 bytes passed as image_embeds rows (``pixel_rows``), which vLLM's processor passes through and this module
patchifies on the GPU. Where the model vLLM builds does not take the wrapper, ``VllmEngine`` runs the tower in the
consumer's process instead.

The encoder is built from the checkpoint's own vision weights (``load_vision_tower``) on the first image batch; the
engine has no tower of its own. It reads no settings: what the consumer decided for it (its model family, whether
and how many embeddings to keep, the vLLM release it checked) arrives as one ``EngineTowerConfig``
(engine_boundary.py), and ``VisionEncoder`` picks its kernels where it runs. Every hook into vLLM's internals is
vlmstream/vllm_adapter.py's; on a vLLM release other than the one they were checked against, nothing is installed.

A clock of CUDA events around each tower forward (``TowerClock``) counts the tower's GPU time there, which the
consumer reads into each result's timings.

With embeddings published, the pixel rows carry a tag per image (``pixel_rows.pack``), and the engine keeps each
tagged image's embedding until the consumer takes it (``EmbeddingTap``): the tower runs once per image for both the
description and the embedding.

Nothing here imports vLLM unless vLLM is installed, and nothing in the consumer's own process imports this module.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import logging
import threading
import weakref

import torch

from consumers.infer import pixel_rows
from consumers.infer.engine_boundary import EngineTowerConfig
from consumers.infer.vision.checkpoint import load_vision_tower
from consumers.infer.vision.encoder import VisionEncoder
from consumers.infer.vision.outputs import mean_pooled, to_host_later
from consumers.infer.vision.pixels import patchify_batch
from vlmstream import vllm_adapter

log = logging.getLogger(__name__)

# Per vLLM model object, held weakly: one engine process builds one model, but nothing here relies on it, and a model
# that goes takes its encoder with it.
_encoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_config: EngineTowerConfig | None = None
_tap: EmbeddingTap | None = None


def config() -> EngineTowerConfig:
    """What the consumer that started this engine decided for the tower here (engine_boundary.py), read once."""
    global _config
    if _config is None:
        _config = EngineTowerConfig.from_environment()
    return _config


class TowerClock:
    """The GPU time of the tower's forwards in this process, from a pair of CUDA events around each: a forward is
    counted once the GPU has passed its second event, so nothing here waits for the GPU. Without it the tower's share
    of a pipeline's GPU time in the engine process could only be guessed from the language model's time alone."""

    def __init__(self, event=None):
        self._event = event  # the CUDA event class; found on the first forward (tests give their own)
        self._lock = threading.Lock()  # the step's forwards and the reports read from another thread
        self._pending: collections.deque = collections.deque()
        self.forwards = 0
        self.images = 0
        self.gpu_ms = 0.0

    def start(self):
        if self._event is None:
            self._event = functools.partial(torch.cuda.Event, enable_timing=True)
        started = self._event()
        started.record()
        return started

    def stop(self, started, images: int) -> None:
        ended = self._event()
        ended.record()
        with self._lock:
            self._pending.append((started, ended, images))
            self._collect()

    def totals(self) -> dict:
        with self._lock:
            self._collect()
            return {"forwards": self.forwards, "images": self.images, "gpu_ms": round(self.gpu_ms, 1)}

    def _collect(self) -> None:
        while self._pending and self._pending[0][1].query():
            started, ended, images = self._pending.popleft()
            self.forwards += 1
            self.images += images
            self.gpu_ms += started.elapsed_time(ended)


CLOCK = TowerClock()


class EmbeddingTap:
    """The embedding of each tagged image the tower encoded here (``pixel_rows`` tags), kept until the consumer takes
    it by its tag (``take``, through ``collective_rpc``). Without it, the consumer would run the tower a second time
    for the embeddings topic.

    An image's embedding is the family's (``VisionEncoder.embedding_width``: the mean of the main merger's tokens,
    DeepStack levels left out), in float16. Each forward's embeddings and tags reach the host by one non-blocking
    copy into page-locked memory, with an event that ``take`` waits on (long passed by then): the engine's step never
    waits for the GPU here. Every tagged image's embedding is kept (rows are tagged only where it is wanted). At most
    ``keep`` embeddings wait (the consumer's bound, ``EngineTowerConfig.embeddings_kept_at_most``); the oldest go
    first (those of requests the consumer never asks about, such as aborted ones), counted in ``dropped``."""

    def __init__(self, keep: int):
        self.keep = keep
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()  # (event or None, tags, embeddings) per forward
        self._ready: collections.OrderedDict = collections.OrderedDict()  # tag -> float16 bytes
        self.kept = 0
        self.taken = 0
        self.dropped = 0

    def put(self, tag_bytes, tokens, width: int) -> None:
        """``tag_bytes`` (n, TAG_BYTES) uint8 and the n images' tokens, on one device."""
        (tag_bytes, embeddings), copied = to_host_later([tag_bytes, mean_pooled(tokens, width)])
        with self._lock:
            self._pending.append((copied, tag_bytes, embeddings))

    def take(self, tags: list[int]) -> dict[int, bytes]:
        """The float16 bytes of the embedding of each of ``tags`` kept here, each given once; tags not kept are left
        out."""
        with self._lock:
            self._settle(wait=False)
            if any(tag not in self._ready for tag in tags):
                self._settle(wait=True)
            found = {tag: self._ready.pop(tag) for tag in tags if tag in self._ready}
            self.taken += len(found)
            return found

    def totals(self) -> dict:
        with self._lock:
            return {"kept": self.kept, "taken": self.taken, "dropped": self.dropped,
                    "waiting": len(self._ready) + sum(len(e) for _, _, e in self._pending)}

    def _settle(self, wait: bool) -> None:
        """Move the forwards whose copies are done (all of them with ``wait``) from pending to ready."""
        while self._pending:
            event, tag_bytes, embeddings = self._pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self._pending.popleft()
            for tag, row in zip(pixel_rows.tag_values(tag_bytes), embeddings.numpy()):
                self._ready[tag] = row.tobytes()
                self.kept += 1
            while len(self._ready) > self.keep:
                self._ready.popitem(last=False)
                self.dropped += 1


def tap() -> EmbeddingTap:
    """This engine process's EmbeddingTap, as large as the consumer asked."""
    global _tap
    if _tap is None:
        _tap = EmbeddingTap(keep=config().embeddings_kept_at_most)
    return _tap


def encoder_for(model) -> VisionEncoder:
    """Our encoder for a vLLM Qwen model: the vision weights of the checkpoint the consumer gave the engine
    (``config().checkpoint``), on the device and in the dtype of vLLM's own tower, of the family the consumer resolved
    (``config().family``)."""
    # vLLM's own tower may be a placeholder on the meta device (an engine started for image_embeds only): the
    # device is the language model's, the dtype the model's.
    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    checkpoint, dtype = config().checkpoint, vllm_adapter.model_dtype(model)
    tower, real_weights = load_vision_tower(checkpoint, device, dtype)
    encoder = VisionEncoder(tower, device, dtype)
    if encoder.family.name != config().family:
        # The pixel rows are packed by the consumer's family: another family would read them wrong.
        raise RuntimeError(f"the vision tower of {checkpoint} in vLLM's engine process is of family "
                           f"{encoder.family.name}, the consumer packs images for {config().family}")
    log.warning("vlmstream's vision tower runs in vLLM's engine process for %s: %d fast blocks, compiled=%s, "
                "attention %s (window blocks: %s), checkpoint weights %s", type(model).__name__,
                encoder.fast.replaced if encoder.fast else 0, encoder.compiled, encoder.attention,
                encoder.window_attention or "the same",
                "loaded" if real_weights else "absent (random tower, as vLLM's dummy weights)")
    return encoder


def through_our_tower(original, build=encoder_for):
    """``original`` (a vLLM model's ``_process_image_input``) with the decoded images given as pixel rows (uint8
    image_embeds, ``pixel_rows``) encoded by our tower, built once per model by ``build`` and patchified here on the
    GPU. Any other input (image embeddings, vLLM's processor's pixel_values) keeps vLLM's own path. Each forward is
    timed by CLOCK; building the encoder (loading and compiling it, on the first batch) is not."""

    @functools.wraps(original)
    def _process_image_input(self, image_input):
        if not pixel_rows.are_pixel_rows(image_input):
            return original(self, image_input)
        encoder = _encoders.get(self)
        if encoder is None:
            encoder = _encoders[self] = build(self)

        def encode():
            grid_thw = image_input["image_grid_thw"]
            images = pixel_rows.unpack(image_input["image_embeds"], grid_thw, encoder.family)
            tag_bytes = pixel_rows.tags(image_input["image_embeds"], grid_thw, encoder.family)
            pixel_values, grid_thw = patchify_batch(images, encoder.device, encoder.dtype, encoder.family)
            # vLLM splits its tower's output per image the same way: merged tokens (then DeepStack levels) per
            # image.
            per_image = tuple(encoder.encode_patches(pixel_values, grid_thw))
            if tag_bytes is not None and config().keep_embeddings:
                tap().put(tag_bytes, per_image, encoder.embedding_width)
            return per_image

        return _clocked(image_input["image_embeds"], encode)

    return _process_image_input


def _clocked(pixels, forward):
    """``forward()``'s per-image outputs, its GPU time counted by CLOCK when its pixels are on the GPU."""
    started = CLOCK.start() if pixels.is_cuda else None
    per_image = forward()
    if started is not None:
        CLOCK.stop(started, len(per_image))
    return per_image


def install(classes=vllm_adapter.MODEL_CLASSES) -> list[str]:
    """Route the pixel rows given to each of ``classes`` (module, class name) through our tower
    (``through_our_tower``); the names of those that now do. Installing twice changes nothing."""
    return vllm_adapter.wrap_image_inputs(through_our_tower, classes)


def model_takes_it(worker) -> dict:
    """The class of the model vLLM's worker built, and whether its image inputs go through our wrapper: a class
    installed above, or one inheriting from it. Without that, pixel rows would reach vLLM's own method as if they were
    embeddings."""
    try:
        model = vllm_adapter.built_model(worker)
    except Exception as exc:  # noqa: BLE001 - no model to ask about is an answer too
        return {"class": None, "wrapped": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"class": type(model).__name__, "wrapped": vllm_adapter.takes_wrapper(model)}


class EngineTowerExtension:
    """vLLM worker extension (``worker_extension_cls``). vLLM imports this module in its worker to find the class,
    and the import installs the tower; its methods, called through ``collective_rpc``, tell the consumer what the
    worker runs and how much GPU time the tower's forwards have taken so far, and hand it the embeddings kept for
    it."""

    def vlmstream_tower_report(self) -> dict:
        return {"installed": list(INSTALLED), "model": model_takes_it(self), "encoders": [
            {"fast_blocks": e.fast.replaced if e.fast else 0, "compiled": e.compiled, "attention": e.attention,
             "image_embeds_width": e.image_embeds_width} for e in _encoders.values()], "clock": CLOCK.totals(),
            "embeddings": tap().totals()}

    def vlmstream_take_embeddings(self, tags: list[int]) -> dict[int, bytes]:
        return tap().take(tags)


def _installed_on_import() -> list[str]:
    """The model classes whose pixel rows go through our tower in this engine process; none without vLLM, and none
    on a vLLM release other than the one the consumer checked, or than the adapter's hooks were checked against (the
    consumer then runs the tower in its own process). The consumer's configuration is read here, so a missing or
    malformed one stops the engine at start."""
    if importlib.util.find_spec("vllm") is None:
        return []
    wanted = config()
    installed = vllm_adapter.installed_vllm()
    problem = vllm_adapter.version_problem(installed)
    if problem is None and installed != wanted.vllm_version:
        problem = f"vLLM {installed} runs the engine, the consumer checked vLLM {wanted.vllm_version}"
    if problem:
        log.warning("vlmstream's vision tower is not installed in vLLM's engine process: %s", problem)
        return []
    return install()


# Installed on import: the only place vLLM lets a worker run code of ours before it builds its model.
INSTALLED = _installed_on_import()
