"""The vLLM engine: continuous batching on one GPU, with the vision front end moved onto the GPU.

Two modes:
- ``embeds`` (default): the family's vision tower (vlmstream/models/; the transformers module with
  vision.FastVisionBlocks: varlen FlashAttention 3 from vLLM, aligned GEMMs, compiled elementwise) runs in vLLM's
  engine process (engine_tower.py), one CUDA context for the tower and the language model: the exact-size uint8
  image travels there as pixel rows (pixel_rows.py), tagged when embeddings are published, and the engine keeps
  each tagged image's embedding until this side takes it (``EngineEmbeddings``), so one tower pass serves both.
  vLLM's single front-end process never touches pixels, which is its wall (see shared/gpu/README.md).
  Where the model vLLM builds does not take our tower, this process runs it instead, with a warning: our thread
  patchifies the images on the GPU and runs the tower on several images per forward, then hands vLLM
  ``image_embeds`` + ``image_grid_thw``. For Qwen3-VL ``image_embeds`` carries the DeepStack levels after the
  merged tokens (``out_hidden_size * (1 + levels)`` wide), which vLLM's Qwen3-VL splits off again; the width is
  checked against vLLM's model config at start and per image before anything is handed over, because a wrong width
  fails inside vLLM's engine process, not on this request. The embedding for the embeddings topic is the mean of
  the main merger's part of the same tower output the language model reads.
- ``pixels``: vLLM gets the uint8 array and does its own normalise/patchify/tower; processor kwargs make
  its resize a no-op. Embeddings, if asked for, cost a separate pass of our tower. The generic path
  (vlmstream/models/generic.py: a model no family module describes) runs only in this mode: the image, decoded,
  oriented and no larger than the model's processor keeps, goes to vLLM's processor as it is, and no embedding
  is published.

Threads: vLLM's ``AsyncLLM`` lives in its own asyncio loop thread (its EngineCore is a child process);
the encoder thread feeds it, so encoding of new images overlaps generation of earlier ones. The encoder thread
keeps the next tower pass queued on the GPU while it waits for one (``_encode_loop``). Requests enter vLLM as soon
as they are encoded: no batch barrier anywhere.

vllm is imported lazily: without it, constructing the engine raises ``EngineUnavailable`` with the
install hint, and this module still imports.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from pathlib import Path

import numpy as np

from consumers.infer import pixel_rows
from consumers.infer.engine import ENGINE_DEAD as _DEAD
from consumers.infer.engine_boundary import EngineTowerConfig
from consumers.infer.engine import (InferenceFailure, InferenceOutput, InferenceRequest,
                                    QueuedEngine)
from consumers.infer.prompts import OutputSchema, PromptBuilder, with_schema
from consumers.infer.vision import (TowerPass, VisionEncoder, block_kernels, groups_by_patches, load_vision_tower,
                                    request_problem)
from vlmstream.config import InferSettings
from vlmstream.models.family import ModelFamily
from vlmstream.models.registry import family_of
from vlmstream import vllm_adapter
from vlmstream.vllm_process import (EngineLoop, EngineUnavailable, child_environment, engine_process_threads,
                                    import_vllm, kernel_args, model_module_failure)

log = logging.getLogger(__name__)



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


# vLLM imports this class's module in its worker before it builds the model (engine_tower.py says why).
ENGINE_TOWER_EXTENSION = "consumers.infer.engine_tower.EngineTowerExtension"
# Most images per forward of the tower in this process (where vLLM's engine does not take it, and for embeddings in
# pixels mode); each forward is also bounded to 65,536 patches (VisionEncoder.max_patches_per_call), which binds
# first for images over 2,048 patches (about 0.4 MP). vLLM's scheduler decides the batches of the tower in its engine.
VISION_BATCH_IMAGES = 32
ENGINE_TOWER_CLOCK_S = 10.0  # how often the consumer reads the engine tower's GPU time (a utility call between steps)


class EngineEmbeddings:
    """The embeddings vLLM's engine process keeps for the pixel rows' tags (engine_tower.EmbeddingTap), taken for
    every request that finished meanwhile in one utility call, not one call per image: the engine answers such calls
    between its steps. ``fetch(tags)`` is that call (``collective_rpc("vlmstream_take_embeddings")``)."""

    def __init__(self, fetch):
        self._fetch = fetch
        self._waiting: dict[int, asyncio.Future] = {}
        self._taking: asyncio.Task | None = None

    async def take(self, tag: int):
        """The float16 embedding kept under ``tag``, or None if the engine kept none."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[tag] = future
        if self._taking is None or self._taking.done():
            self._taking = asyncio.ensure_future(self._take_waiting())
        return await future

    async def _take_waiting(self) -> None:
        # One call for every tag that waits, again for those that came while a call ran: no tag is left waiting.
        while self._waiting:
            waiting, self._waiting = self._waiting, {}
            try:
                found = await self._fetch(list(waiting))
            except Exception as exc:  # noqa: BLE001 - each waiting request fails with the call's error
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for tag, future in waiting.items():
                if not future.done():
                    kept = found.get(tag)
                    future.set_result(None if kept is None else np.frombuffer(kept, dtype=np.float16))


class VllmEngine(QueuedEngine):
    engine_label = "vLLM engine"
    name = "vllm"
    ignore_eos = False

    def __init__(self, model_path: str | Path, settings: InferSettings, mode: str | None = None, *,
                 load_format: str = "auto", embeds_only_engine: bool = True, vision_attention: str = "auto",
                 engine_kwargs: dict | None = None, ignore_eos: bool = False):
        """``load_format="dummy"``: random weights (a folder without safetensors); our tower is then random
        too. ``embeds_only_engine``: in embeds mode, tell vLLM images arrive only as embeddings
        (``limit_mm_per_prompt`` image 0 + ``enable_mm_embeds``), so it neither builds nor profiles its own
        vision tower; False keeps vLLM's tower (the path shared/gpu/bench.py measured). ``engine_kwargs`` (vLLM
        engine arguments over ours) and ``ignore_eos`` (every output runs to its token budget, guided ones excepted)
        are for benchmarks, which compare arms at one output length and without caches that only some arms can
        use."""
        self.ignore_eos = ignore_eos
        self.mode = mode or settings.mode
        if self.mode not in ("embeds", "pixels"):
            raise ValueError(f"vllm mode must be 'embeds' or 'pixels', got {self.mode!r}")
        self._v = import_vllm("infer.engine")
        import torch

        if not torch.cuda.is_available():
            raise EngineUnavailable("the vllm engine needs a CUDA device; none is visible here "
                                    "(set infer.engine=transformers to run on CPU)")
        self._torch = torch
        self._tags = itertools.count(1)
        self.model_path = str(model_path)
        self.model_id = settings.model or self.model_path
        self.revision = settings.revision
        self.schema = OutputSchema.load(settings.output_schema)
        self._ids = itertools.count()
        # The family (patch size, normalisation, tower, limits) from the checkpoint's config.json: an unknown model
        # fails here, naming infer.model, before vLLM starts.
        self.family = family_of(self.model_path)
        if not self.family.exact_size and self.mode == "embeds":
            raise ValueError(f"infer.model {self.model_path} has no model family in vlmstream/models (the generic path): "
                             "its tower is vLLM's, so set infer.mode=pixels")

        # Embeds mode runs our tower in vLLM's engine process (one CUDA context; on an H200 at 0.2 MP with
        # embeddings 4% faster than the tower in this process, and the fastest path measured at 12.8 MP). A model
        # whose vLLM class does not take it, or a vLLM release other than the one vllm_adapter's hooks were checked
        # against, runs the tower here instead (below).
        self.settings = settings
        tower_problem = vllm_adapter.version_problem(self._v.version) if self.mode == "embeds" else None
        if tower_problem:
            log.warning("%s: the vision tower runs in this process, not in vLLM's engine process", tower_problem)
        self._set_tower_place(self.mode == "embeds" and tower_problem is None)

        from transformers import AutoTokenizer

        self.prompts = PromptBuilder(AutoTokenizer.from_pretrained(self.model_path, revision=settings.revision),
                                     self.family)

        self._init_queues()
        self._tasks: set[asyncio.Future] = set()

        # 1. vLLM first: it sizes its KV cache from the free memory it sees, so our tower loads afterwards
        #    into the (1 - gpu_memory_utilization) share it leaves.
        self._engine_loop = EngineLoop("vllm-loop")
        embeds_only = self.mode == "embeds" and embeds_only_engine
        args = dict(
            model=self.model_path, revision=settings.revision, dtype=settings.dtype,
            max_model_len=settings.max_model_len, gpu_memory_utilization=settings.gpu_memory_utilization,
            load_format=load_format, seed=0, disable_log_stats=True,
            enable_mm_embeds=self.mode == "embeds",
            # Every image is new: caching processed inputs only costs memory and hashing. Prefix caching still
            # reuses the prompt text before the image, which every request shares.
            mm_processor_cache_gb=0, enable_prefix_caching=True,
        )
        # Scheduler limits only when set: vLLM's own choice depends on the GPU, and a larger token budget than it
        # would pick costs KV-cache memory on smaller cards.
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(settings, name) is not None:
                args[name] = getattr(settings, name)
        from vllm.config import StructuredOutputsConfig

        # No free whitespace in guided JSON: a random or weak model would otherwise spend its whole token budget
        # on blanks between tokens (seen on the H200 with dummy weights). vLLM 0.26 reads this switch from the
        # engine's config, not from the request's StructuredOutputsParams. It only affects guided requests.
        args["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
        args.update(kernel_args(self.model_path))
        self._engine_kwargs = engine_kwargs or {}
        started = time.perf_counter()
        self.engine_tower_report: dict | None = None  # what vLLM's worker runs, with our tower there
        # With our tower in vLLM's engine process: its GPU ms per image there over the last clock reading, in each
        # result's timings as encode_ms_per_image (what the tower in this process reports as encode_ms).
        self.engine_tower_ms_per_image: float | None = None
        self._tower_watch = None
        embeds_only = self._start_vllm(args, embeds_only)
        if self._tower_in_engine:
            problem = self._engine_tower_problem()
            if problem:
                log.warning("%s; running the vision tower in this process instead", problem)
                self._engine_loop.shutdown_llm(self.llm)
                self._engine_loop.reap_children()
                self._set_tower_place(False)
                embeds_only = self._start_vllm(args, embeds_only)  # as the first start found it to work
            else:
                self._tower_watch = self._engine_loop.submit(self._watch_engine_tower())
        self.start_s = time.perf_counter() - started
        scheduler = self.llm.vllm_config.scheduler_config
        self.batch_size = scheduler.max_num_seqs  # what the runner sizes its in-flight window by
        self.step_tokens = scheduler.max_num_batched_tokens
        # gpu_bench reads this line (arm_pipeline.engine_scheduler_limits)
        log.info("vLLM %s up in %.1fs (mode=%s, embeds_only=%s, scheduler limits %s)", self._v.version, self.start_s,
                 self.mode, embeds_only, {"max_num_seqs": self.batch_size, "max_num_batched_tokens": self.step_tokens})

        # 2. Our vision tower here: in embeds mode unless it runs in vLLM's engine; in pixels mode only when
        #    embeddings are published.
        self.encoder: VisionEncoder | None = None
        self.tower_has_real_weights = False
        self.image_embeds_width = (expected_image_embeds_width(self.llm.vllm_config.model_config.hf_config)
                                   if self.family.exact_size else None)
        if self.family.exact_size and (self._embeds_here() or (settings.publish_embeddings
                                                                and self._engine_embeddings is None)):
            dtype = torch.bfloat16
            tower, self.tower_has_real_weights = load_vision_tower(self.model_path, "cuda", dtype)
            if not self.tower_has_real_weights and load_format != "dummy":
                log.warning("no vision weights in %s: the tower is random, embeddings are meaningless", model_path)
            self.encoder = VisionEncoder(tower, "cuda", dtype, attention=vision_attention, family=self.family)
            if self._embeds_here() and self.encoder.image_embeds_width != self.image_embeds_width:
                self._engine_loop.shutdown_llm(self.llm)
                self._engine_loop.stop()
                self._engine_loop.reap_children()
                raise RuntimeError(
                    f"the vision tower of {self.model_path} makes image_embeds {self.encoder.image_embeds_width} wide "
                    f"({self.encoder.deepstack_levels} DeepStack levels), vLLM's {self.family.name} model takes "
                    f"{self.image_embeds_width}: set infer.mode=pixels to let vLLM run its own tower")
            log.info("vision tower on cuda, attention=%s, compiled=%s, kernels %s, image_embeds %d wide",
                     self.encoder.attention, self.encoder.compiled, block_kernels(self.encoder.fast),
                     self.encoder.image_embeds_width)
        # High priority: the tower feeds the language model. When both have kernels queued, the tower's go
        # first, so the engine's queue of ready requests does not run dry while it decodes.
        self._stream = torch.cuda.Stream(priority=-1)
        self._last_pass_finished = 0.0  # when the encoder thread last finished waiting for a tower pass

        # 3. The encoder thread feeds vLLM.
        self._start_worker(self._encode_loop, "vllm-encoder")

    def _set_tower_place(self, in_engine: bool) -> None:
        """Where embeds mode runs our tower: in vLLM's engine process, shipping the decoded image there as pixel rows
        (consumers/infer/pixel_rows.py), or here, shipping image_embeds to vLLM."""
        self._tower_in_engine = in_engine
        # Then the engine also keeps each image's embedding, found by the tag its pixel rows carry.
        self._engine_embeddings = (EngineEmbeddings(self._take_engine_embeddings)
                                   if in_engine and self.settings.publish_embeddings else None)

    def _start_vllm(self, base_args: dict, embeds_only: bool) -> bool:
        """Start vLLM's engine with ``base_args`` and what the tower's place adds. ``embeds_only``: images arrive
        only as embeddings (``limit_mm_per_prompt`` image 0), so vLLM neither builds nor profiles its own tower;
        returns it as it ended up (see the retry below)."""
        # vLLM imports this extension's module in its worker, which installs our tower there (engine_tower.py),
        # configured by what this process decided (engine_boundary.py), in the engine process's environment.
        tower_args = {"worker_extension_cls": ENGINE_TOWER_EXTENSION} if self._tower_in_engine else {}
        tower_env = (EngineTowerConfig.for_engine(self.model_path, self.family, self.settings, self._v.version)
                     .environment() if self._tower_in_engine else {})
        args = {**base_args, **tower_args, **self._engine_kwargs,
                "limit_mm_per_prompt": {"image": 0 if embeds_only else 1, "video": 0}}
        try:
            try:
                with child_environment(tower_env), engine_process_threads():
                    self.llm = self._engine_loop.start_llm(self._v, self._v.AsyncEngineArgs(**args))
            except Exception as exc:
                if not embeds_only:
                    raise
                # vLLM 0.26 cannot build Qwen3-VL's language model without its tower: the DeepStack buffers stay
                # on the meta device and the compile fails (seen on an H200 with the Qwen3-VL-8B config). The engine
                # with its tower kept takes the same image_embeds and gives the same outputs; it only holds the
                # tower's weights and profiles it at start.
                log.warning("vLLM %s would not start %s with images as embeddings only (%s: %s); starting it "
                            "again with its own vision tower kept", self._v.version, self.model_path,
                            type(exc).__name__, str(exc)[:300])
                self._engine_loop.reap_children()
                embeds_only = False
                args["limit_mm_per_prompt"] = {"image": 1, "video": 0}
                with child_environment(tower_env), engine_process_threads():
                    self.llm = self._engine_loop.start_llm(self._v, self._v.AsyncEngineArgs(**args))
        except Exception as exc:
            self._engine_loop.stop()
            self._engine_loop.reap_children()
            cause = model_module_failure(self.model_path)
            raise RuntimeError(f"vLLM {self._v.version} cannot serve infer.model {self.model_path!r} "
                               f"(mode {self.mode}): {type(exc).__name__}: {exc}"
                               + (f"; {cause}" if cause else "")) from exc
        except BaseException:
            self._engine_loop.stop()
            raise
        return embeds_only

    def _engine_tower_problem(self) -> str | None:
        """Log what vLLM's worker says it runs (engine_tower.EngineTowerExtension); why the engine did not take it,
        or None."""
        try:
            report = self.tower_report(timeout_s=120)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the engine did not take our tower
            report = {"installed": [], "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        self.engine_tower_report = report
        log.info("vLLM's engine process, vlmstream's tower wrapper: %s", report)  # plan_x1.sh's readers look for it
        if not report.get("installed") or not report.get("model", {}).get("wrapped"):
            return f"the model vLLM {self._v.version} built does not take vlmstream's tower wrapper ({report})"
        if not report.get("encoders"):
            log.warning("vLLM ran no image at start, so the tower in its engine process is built (and compiled) on "
                        "the first batch")
        return None

    def _embeds_here(self) -> bool:
        """Whether this process makes the image_embeds vLLM gets (embeds mode, tower not in vLLM's engine)."""
        return self.mode == "embeds" and not self._tower_in_engine

    async def _tower_report(self) -> dict:
        """What the wrapper in vLLM's worker reports (engine_tower.EngineTowerExtension): one worker, one GPU."""
        return (await self.llm.collective_rpc("vlmstream_tower_report"))[0]

    def tower_report(self, timeout_s: float = 10) -> dict:
        """What vLLM's worker reports now (engine_tower.EngineTowerExtension): the tower it runs, its clock and the
        embeddings it keeps."""
        return self._engine_loop.call(self._tower_report(), timeout_s)

    async def _take_engine_embeddings(self, tags: list[int]) -> dict[int, bytes]:
        return (await self.llm.collective_rpc("vlmstream_take_embeddings", args=(tags,)))[0]

    async def _watch_engine_tower(self) -> None:
        """Read the engine tower's clock (engine_tower.TowerClock) every ENGINE_TOWER_CLOCK_S: its GPU ms per image
        since the last reading becomes engine_tower_ms_per_image."""
        last = None
        while True:
            await asyncio.sleep(ENGINE_TOWER_CLOCK_S)
            try:
                clock = (await self._tower_report())["clock"]
            except Exception as exc:  # noqa: BLE001 - a clock that cannot be read only leaves the timing out
                log.warning("the engine tower's clock could not be read (%s: %s); its timings stay out of results",
                            type(exc).__name__, str(exc)[:200])
                return
            if last is not None and clock["images"] > last["images"]:
                self.engine_tower_ms_per_image = round(
                    (clock["gpu_ms"] - last["gpu_ms"]) / (clock["images"] - last["images"]), 2)
            last = clock

    def _log_engine_tower_clock(self) -> None:
        self._tower_watch.cancel()
        try:
            report = self.tower_report()
            clock = report["clock"]
        except Exception as exc:  # noqa: BLE001 - only a closing log line is lost
            # A stop by signal reaches vLLM's engine process too: it may be gone before this reading.
            log.warning("the engine tower's clock could not be read at close (%s: %s)", type(exc).__name__,
                        str(exc)[:200])
            return
        log.info("the vision tower in vLLM's engine process: %d images in %d forwards, %.1f GPU ms per image; "
                 "embeddings kept there for this process: %s", clock["images"], clock["forwards"],
                 clock["gpu_ms"] / max(1, clock["images"]), report.get("embeddings"))

    # ----------------------------------------------------------------------------- Engine protocol

    def close(self) -> None:
        """Stop feeding, shut vLLM's EngineCore down, and make sure no child process outlives us."""
        if not self._stop_worker():
            return
        if self._tower_watch is not None:
            self._log_engine_tower_clock()
        try:
            self._engine_loop.shutdown_llm(self.llm)
        except Exception as exc:
            log.warning("vLLM shutdown: %r", exc)
        self._engine_loop.stop()
        self._engine_loop.reap_children()
        self.encoder = None
        self._torch.cuda.empty_cache()

    # ----------------------------------------------------------------------------- encoder thread

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

    def _dispatch(self, items: list[tuple[InferenceRequest, float]], encoded: dict) -> None:
        for request, submitted in items:
            result = encoded.get(request.request_id)
            if isinstance(result, InferenceFailure):
                self._outbox.put(result)
                continue
            image_embeds, embedding, timings = result if result else (None, None, {})
            timings = {"queue_ms": (time.perf_counter() - submitted) * 1e3 - timings.get("encode_ms", 0.0), **timings}
            embedding_tag = None  # under which vLLM's engine keeps this image's embedding
            if self.mode == "pixels":
                mm_item = request.image
            else:  # image_embeds from our tower here, or the image's own bytes for our tower in the engine
                if self._tower_in_engine:
                    # Tagged where the engine is to keep the image's embedding for this process.
                    keep = bool(self._engine_embeddings and request.want_embedding)
                    embedding_tag = pixel_rows.make_tag(next(self._tags), keep) if keep else None
                    rows = pixel_rows.pack(request.image, request.grid_thw, self.family, embedding_tag)
                else:
                    rows = image_embeds
                mm_item = {"image_embeds": rows, "image_grid_thw": self._torch.tensor([list(request.grid_thw)])}
            future = self._engine_loop.submit(
                self._generate(request, mm_item, embedding if request.want_embedding else None, timings,
                               embedding_tag))
            self._tasks.add(future)
            future.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------------------- asyncio side

    async def _generate(self, request: InferenceRequest, mm_item, embedding, timings: dict,
                        embedding_tag: int | None = None) -> None:
        # A retried request reuses its request_id; vLLM needs ids unique among live requests.
        engine_request_id = f"{request.request_id}#{next(self._ids)}"
        prompt = {"prompt": self.prompts.prompt(request.prompt), "multi_modal_data": {"image": mm_item},
                  # A caller-supplied uuid spares vLLM hashing the pixels or the embeddings of every image.
                  "multi_modal_uuids": {"image": [engine_request_id]}}
        if self.mode == "pixels" and self.family.exact_size:
            height, width = request.image.shape[:2]
            # The family's processor bounds; an exact-size image inside them is not resized by vLLM.
            prompt["mm_processor_kwargs"] = {"min_pixels": min(self.family.min_pixels, height * width),
                                             "max_pixels": max(self.family.max_pixels, height * width),
                                             "do_resize": False}
        started = time.perf_counter()
        try:
            final = None
            async for output in self.llm.generate(prompt, self._sampling_params(request.max_new_tokens),
                                                  engine_request_id):
                final = output
            if final is not None and final.outputs and final.outputs[0].finish_reason == "abort":
                # We never abort requests ourselves: an abort means the engine is going away (its EngineCore
                # got a signal). That is fatal, not this image's fault; dead-lettering it would record a
                # failure for work the next owner of the partition redoes.
                self._dead = RuntimeError("vLLM aborted a request: the engine is shutting down")
                self._outbox.put(_DEAD)
                return
            timings = {**timings, "generate_ms": (time.perf_counter() - started) * 1e3}
            if self.engine_tower_ms_per_image is not None:
                timings["encode_ms_per_image"] = self.engine_tower_ms_per_image
            if embedding_tag is not None:
                embedding = await self._engine_embeddings.take(embedding_tag)
            if embedding_tag is not None and embedding is None:
                # Never published without its embedding: the runner retries the image (a new tag, a new pass).
                result = InferenceFailure(request.request_id, "inference_error",
                                          "vLLM's engine process kept no embedding for this image (the tower there "
                                          "with infer.publish_embeddings)")
            else:
                result = self._output(request, final, embedding, timings)
        except asyncio.CancelledError:
            raise
        except self._v.DeadError as exc:
            self._dead = exc
            self._outbox.put(_DEAD)
            return
        except ValueError as exc:  # vLLM's verdict on this request's input: the same input fails again
            result = InferenceFailure(request.request_id, "invalid_request", str(exc)[:2000], retriable=False)
        except Exception as exc:
            cause = exc.__cause__ or exc
            result = InferenceFailure(request.request_id, "inference_error", f"{type(cause).__name__}: {cause}"[:2000])
        self._outbox.put(result)

    def _sampling_params(self, max_tokens: int):
        v = self._v
        structured = None
        if self.schema is not None:
            # No free whitespace: a random or weak model would otherwise spend its token budget on blanks.
            structured = v.StructuredOutputsParams(json=self.schema.schema, disable_any_whitespace=True)
        # A guided document ends where its grammar ends: ignoring EOS there made vLLM generate past the closing
        # brace (seen on the H200: `{...}<filler>...`, every output a schema violation).
        return v.SamplingParams(max_tokens=max_tokens, temperature=self.settings.temperature,
                                ignore_eos=self.ignore_eos and structured is None,
                                structured_outputs=structured,
                                output_kind=v.RequestOutputKind.FINAL_ONLY)

    def _output(self, request: InferenceRequest, final, embedding, timings: dict):
        if final is None or not final.outputs:
            return InferenceFailure(request.request_id, "inference_error", "vLLM returned no output")
        completion = final.outputs[0]
        if completion.finish_reason == "abort":
            return InferenceFailure(request.request_id, "inference_error", "vLLM aborted the request")
        output = InferenceOutput(
            request_id=request.request_id,
            text=completion.text,
            prompt_tokens=len(final.prompt_token_ids or []),
            output_tokens=len(completion.token_ids),
            visual_tokens=self._visual_tokens(request, final),
            embedding=embedding,
            timings_ms=timings,
        )
        return with_schema(self.schema, output)

    def _visual_tokens(self, request: InferenceRequest, final) -> int:
        if self.family.exact_size:
            return self.family.visual_tokens(request.grid_thw)
        # The generic path: the image tokens vLLM's processor put in the prompt.
        config = self.llm.vllm_config.model_config.hf_config
        token = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
        return sum(1 for t in (final.prompt_token_ids or []) if t == token) if token is not None else 0
