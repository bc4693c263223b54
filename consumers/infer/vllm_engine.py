"""The vLLM engine: continuous batching on one GPU, with the vision front end moved onto the GPU.

Two modes:
- ``embeds`` (default): the family's vision tower (vlmstream/models/; the transformers module with
  vision.blocks.FastVisionBlocks: varlen FlashAttention 3 from vLLM, aligned GEMMs, compiled elementwise) runs in
  vLLM's engine process (engine_tower.py), one CUDA context for the tower and the language model: the exact-size uint8
  image travels there as pixel rows (pixel_rows.py), tagged when embeddings are published, and the engine keeps
  each tagged image's embedding until this side takes it (``EngineEmbeddings``), so one tower pass serves both.
  vLLM's single front-end process never touches pixels: its own processor, which normalises and patchifies every
  image on the CPU there, is what bounds `vllm serve` at small image sizes (docs/benchmarks.md).
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
the encoder thread feeds it (vllm_encoder_thread.py), so encoding of new images overlaps generation of earlier
ones. Requests enter vLLM as soon as they are encoded: no batch barrier anywhere. What this process asks of our
tower in vLLM's engine process is vllm_engine_tower.py's.

vllm is imported lazily: without it, constructing the engine raises ``EngineUnavailable`` with the
install hint, and this module still imports.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path

from consumers.infer import pixel_rows
from consumers.infer.engine import ENGINE_DEAD as _DEAD
from consumers.infer.engine import InferenceFailure, InferenceOutput, InferenceRequest, QueuedEngine
from consumers.infer.prompts import OutputSchema, PromptBuilder, with_schema
from consumers.infer.vision.blocks import block_kernels
from consumers.infer.vision.checkpoint import load_vision_tower
from consumers.infer.vision.encoder import VisionEncoder
from consumers.infer.vllm_encoder_thread import EncoderThread, expected_image_embeds_width
from consumers.infer.vllm_engine_tower import EngineTowerSide
from vlmstream import vllm_adapter
from vlmstream.config import InferSettings
from vlmstream.models.registry import deepstack_levels, family_of
from vlmstream.vllm_process import (EngineLoop, EngineUnavailable, child_environment, engine_process_threads,
                                    import_vllm, kernel_args, model_module_failure)

log = logging.getLogger(__name__)


class VllmEngine(EngineTowerSide, EncoderThread, QueuedEngine):
    engine_label = "vLLM engine"
    name = "vllm"
    ignore_eos = False

    def __init__(self, model_path: str | Path, settings: InferSettings, mode: str | None = None, *,
                 load_format: str = "auto", embeds_only_engine: bool = True, vision_attention: str = "auto",
                 engine_kwargs: dict | None = None, ignore_eos: bool = False):
        """``load_format="dummy"``: random weights (a folder without safetensors); our tower is then random
        too. ``embeds_only_engine``: in embeds mode, tell vLLM images arrive only as embeddings
        (``limit_mm_per_prompt`` image 0 + ``enable_mm_embeds``), so it neither builds nor profiles its own
        vision tower; False keeps vLLM's tower (benchmarks/gpu's offline arm measures that path).
        ``engine_kwargs`` (vLLM engine arguments over ours) and ``ignore_eos`` (every output runs to its token
        budget, guided ones excepted) are for benchmarks, which compare arms at one output length and without caches
        that only some arms can use."""
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

        # Embeds mode runs our tower in vLLM's engine process: one CUDA context, and the image crosses as its own
        # bytes, not as embeddings up to 11x larger (Qwen3-VL's DeepStack levels), which is where it beats the tower
        # here (docs/benchmarks.md). A model whose vLLM class does not take it, or a vLLM release other than the one
        # vllm_adapter's hooks were checked against, runs the tower here instead (below).
        self.settings = settings
        tower_problem = vllm_adapter.version_problem() if self.mode == "embeds" else None
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
        # Qwen3-VL's embeddings carry DeepStack levels, which vLLM's model splits off only while it builds its own
        # tower: without the tower vLLM 0.26 fails to build the language model (its DeepStack buffers stay on the
        # meta device) and 0.34 builds it without DeepStack, where image_embeds of the full width no longer fit. Such
        # a model keeps vLLM's tower; it takes the same image_embeds and only holds and profiles the tower's weights.
        embeds_only = self.mode == "embeds" and embeds_only_engine and not deepstack_levels(self.model_path)
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
        # No free whitespace in guided JSON: a random or weak model would otherwise spend its whole token budget
        # on blanks between tokens (seen on the H200 with dummy weights). vLLM 0.26 reads this switch from the
        # engine's config, not from the request's StructuredOutputsParams. It only affects guided requests.
        args["structured_outputs_config"] = self._v.StructuredOutputsConfig(backend="guidance",
                                                                            disable_any_whitespace=True)
        args.update(kernel_args(self.model_path))
        self._engine_kwargs = engine_kwargs or {}
        started = time.perf_counter()
        self.engine_tower_report: dict | None = None  # what vLLM's worker runs, with our tower there
        # With our tower in vLLM's engine process: its GPU ms per image there over the last clock reading, in each
        # result's timings as encode_ms_per_image (what the tower in this process reports as encode_ms).
        self.engine_tower_ms_per_image: float | None = None
        self._tower_watch = None
        self._start_vllm(args, embeds_only)
        if self._tower_in_engine:
            problem = self._engine_tower_problem()
            if problem:
                log.warning("%s; running the vision tower in this process instead", problem)
                self._engine_loop.shutdown_llm(self.llm)
                self._engine_loop.reap_children()
                self._set_tower_place(False)
                self._start_vllm(args, embeds_only)
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

    def _start_vllm(self, base_args: dict, embeds_only: bool) -> None:
        """Start vLLM's engine with ``base_args`` and what the tower's place adds. ``embeds_only``: images arrive
        only as embeddings (``limit_mm_per_prompt`` image 0), so vLLM neither builds nor profiles its own tower."""
        tower_args, tower_env = self._engine_tower_start()
        args = {**base_args, **tower_args, **self._engine_kwargs,
                "limit_mm_per_prompt": {"image": 0 if embeds_only else 1, "video": 0}}
        try:
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
                    if self._engine_embeddings and request.want_embedding:
                        embedding_tag = next(self._tags)
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
