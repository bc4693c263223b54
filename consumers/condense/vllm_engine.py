"""The vLLM condense engine: continuous batching on one GPU, answers constrained by vLLM's structured outputs (guided
JSON against the answer schema, the ``guidance`` backend, no free whitespace).

By default the model is the inference stage's checkpoint (``infer.model``): for a vision-language checkpoint vLLM is
told that no prompt carries images or video (``limit_mm_per_prompt`` 0), so it builds and profiles no vision tower
and runs the language model on text; any text model vLLM serves works too (``condense.model``). Beside `vlmstream
infer` on one GPU, ``condense.gpu_memory_utilization`` is this engine's share of the GPU's memory.

Threads: ``AsyncLLM`` lives in its own asyncio loop thread (its EngineCore is a child process); the worker thread
hands every submitted document to it at once: no batch barrier. vllm is imported lazily, so this module imports
without it; constructing the engine without it raises ``EngineUnavailable``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path
from types import SimpleNamespace

from consumers.condense.engine import CondenseFailure, CondenseOutput, CondenseRequest, is_multimodal
from consumers.condense.stage import AnswerSchema
from vlmstream.config import CondenseSettings
from vlmstream.queued_engine import ENGINE_DEAD, QueuedEngine
from vlmstream.vllm_process import (EngineLoop, EngineUnavailable, engine_process_threads, import_vllm, kernel_args,
                                    model_module_failure)

log = logging.getLogger(__name__)



def engine_args(settings: CondenseSettings, model_path: str, v: SimpleNamespace, *, load_format: str,
                multimodal: bool) -> dict:
    """The AsyncEngineArgs keywords (separate, so a benchmark or a test can read them without a GPU)."""
    args = dict(
        model=model_path, revision=settings.revision, dtype=settings.dtype, max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization, load_format=load_format, seed=0,
        # Prefix caching: every document's prompt starts with the same instruction.
        disable_log_stats=True, enable_prefix_caching=True,
        # Guided JSON without free whitespace: a random or weak model would spend its token budget on blanks. vLLM
        # 0.26 reads this switch from the engine's config as well as from the request.
        structured_outputs_config=v.StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True),
    )
    if multimodal:
        # Text only: no vision tower is built or profiled, its memory goes to the KV cache.
        args["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(settings, name) is not None:
            args[name] = getattr(settings, name)
    args.update(kernel_args(model_path))
    return args


class VllmCondenseEngine(QueuedEngine):
    engine_label = "vLLM condense engine"
    name = "vllm"

    def __init__(self, model_path: str | Path, settings: CondenseSettings, answer_schema: AnswerSchema, *,
                 load_format: str = "auto", engine_kwargs: dict | None = None):
        self._v = import_vllm("condense.engine")
        import torch

        if not torch.cuda.is_available():
            raise EngineUnavailable("the vllm condense engine needs a CUDA device; none is visible here "
                                    "(set condense.engine=transformers to run on CPU)")
        from transformers import AutoTokenizer

        if settings.max_prompt_tokens + settings.max_new_tokens > settings.max_model_len:
            raise ValueError(f"condense.max_prompt_tokens ({settings.max_prompt_tokens}) + condense.max_new_tokens "
                             f"({settings.max_new_tokens}) exceed condense.max_model_len ({settings.max_model_len})")
        self.settings = settings
        self.model_path = str(model_path)
        self.model_id = settings.model or self.model_path
        self.revision = settings.revision
        self.answer_schema = answer_schema
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, revision=settings.revision)
        self._ids = itertools.count()
        self._init_queues()
        self._engine_loop = EngineLoop("condense-vllm-loop")
        args = engine_args(settings, self.model_path, self._v, load_format=load_format,
                           multimodal=is_multimodal(self.model_path))
        args.update(engine_kwargs or {})
        started = time.perf_counter()
        try:
            with engine_process_threads():
                self.llm = self._engine_loop.start_llm(self._v, self._v.AsyncEngineArgs(**args))
        except Exception as exc:
            self._engine_loop.stop()
            cause = model_module_failure(self.model_path)
            if cause is None:
                raise
            raise RuntimeError(f"vLLM {self._v.version} cannot serve the condense model {self.model_path!r} "
                               f"(condense.model): {type(exc).__name__}: {exc}; {cause}") from exc
        except BaseException:
            self._engine_loop.stop()
            raise
        self.start_s = time.perf_counter() - started
        scheduler = self.llm.vllm_config.scheduler_config
        self.batch_size = scheduler.max_num_seqs
        log.info("condense: vLLM %s up in %.1fs (text only=%s, scheduler limits %s)", self._v.version, self.start_s,
                 "limit_mm_per_prompt" in args, {"max_num_seqs": self.batch_size,
                                                 "max_num_batched_tokens": scheduler.max_num_batched_tokens})
        try:
            self._engine_loop.call(self._probe(), timeout=300)
        except ValueError as exc:
            self._close_engine()
            raise ValueError(f"condense.answer_schema ({answer_schema.schema_id}): vLLM's guided decoding refuses "
                             f"it: {exc}") from exc
        self._start_worker(self._feed, "condense-vllm-feed")

    def close(self) -> None:
        if not self._stop_worker():
            return
        self._close_engine()

    def _close_engine(self) -> None:
        try:
            self._engine_loop.shutdown_llm(self.llm)
        except Exception as exc:  # noqa: BLE001
            log.warning("vLLM shutdown: %r", exc)
        self._engine_loop.stop()
        self._engine_loop.reap_children()

    def _feed(self) -> None:
        try:
            stopping = False
            while not stopping:
                batch, stopping = self._next_batch(1024)
                for request, submitted in batch:
                    self._engine_loop.submit(self._generate(request, submitted))
        except BaseException as exc:
            log.exception("vLLM condense feed thread died")
            self._dead = exc
            self._outbox.put(ENGINE_DEAD)


    async def _probe(self) -> None:
        """One token under the answer schema's grammar: a schema the guided-decoding backend cannot compile is
        refused here, at start, rather than dead-lettering every document."""
        prompt = {"prompt_token_ids": self.tokenizer.encode("{", add_special_tokens=False) or [0]}
        async for _ in self.llm.generate(prompt, self.sampling_params(1), "condense-schema-probe"):
            pass

    def sampling_params(self, max_tokens: int):
        v = self._v
        structured = v.StructuredOutputsParams(json=self.answer_schema.schema, disable_any_whitespace=True)
        return v.SamplingParams(max_tokens=max_tokens, temperature=self.settings.temperature,
                                structured_outputs=structured, output_kind=v.RequestOutputKind.FINAL_ONLY)

    async def _generate(self, request: CondenseRequest, submitted: float) -> None:
        engine_request_id = f"{request.request_id}#{next(self._ids)}"  # a retry reuses the runner's id
        started = time.perf_counter()
        try:
            final = None
            async for output in self.llm.generate({"prompt_token_ids": list(request.prompt_ids)},
                                                  self.sampling_params(request.max_new_tokens), engine_request_id):
                final = output
            if final is None or not final.outputs:
                result = CondenseFailure(request.request_id, "condense_error", "vLLM returned no output")
            elif final.outputs[0].finish_reason == "abort":
                # We never abort requests: an abort means the engine is going away. Fatal, not this document's fault.
                self._dead = RuntimeError("vLLM aborted a request: the engine is shutting down")
                self._outbox.put(ENGINE_DEAD)
                return
            else:
                completion = final.outputs[0]
                result = CondenseOutput(
                    request_id=request.request_id, text=completion.text, prompt_tokens=len(request.prompt_ids),
                    output_tokens=len(completion.token_ids), finish_reason=completion.finish_reason or "stop",
                    timings_ms={"queue_ms": (started - submitted) * 1e3,
                                "generate_ms": (time.perf_counter() - started) * 1e3})
        except asyncio.CancelledError:
            raise
        except self._v.DeadError as exc:
            self._dead = exc
            self._outbox.put(ENGINE_DEAD)
            return
        except ValueError as exc:  # vLLM's verdict on this request's input (too long, a schema it cannot compile)
            result = CondenseFailure(request.request_id, "invalid_request", str(exc)[:2000], retriable=False)
        except Exception as exc:  # noqa: BLE001
            cause = exc.__cause__ or exc
            result = CondenseFailure(request.request_id, "condense_error", f"{type(cause).__name__}: {cause}"[:2000])
        self._outbox.put(result)
