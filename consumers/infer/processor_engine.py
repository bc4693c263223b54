"""The transformers engine for the generic path (vlmstream/models/generic.py): a model no family module describes,
run by its own processor and ``generate``, on CPU or CUDA.

The images arrive decoded, oriented and no larger than the processor keeps; the processor does the model's own
resize, normalisation and patching, and the model its own tower. Batching, retries and output trimming are
``TransformersEngine``'s. No embedding is published on this path: the model's tower runs inside ``generate``, and a
second pass for a mean vector would double the vision work (a family module is how a model gets embeddings).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

from consumers.infer.engine import (EngineCannotLoadModel, InferenceOutput, InferenceRequest,
                                    limit_cpu_use)
from consumers.infer.prompts import OutputSchema, with_schema
from consumers.infer.transformers_engine import TransformersEngine, resolve_dtype
from vlmstream.config import InferSettings
from vlmstream.models.family import ModelFamily

log = logging.getLogger(__name__)


class ProcessorEngine(TransformersEngine):
    engine_label = "transformers engine (model's own processor)"

    def __init__(self, model_path: str | Path, settings: InferSettings, family: ModelFamily,
                 device: str | None = None, ignore_eos: bool = False):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.ignore_eos = ignore_eos  # benchmarks only, as TransformersEngine takes it
        self.settings = settings
        self.family = family
        self.model_id = settings.model or str(model_path)
        self.revision = settings.revision
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        limit_cpu_use(settings, self.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.batch_size = max(1, settings.batch_size)
        self.step_tokens = None
        self._torch = torch
        self.encoder = None
        try:
            self.processor = AutoProcessor.from_pretrained(str(model_path), revision=settings.revision)
            self.model = AutoModelForImageTextToText.from_pretrained(
                str(model_path), revision=settings.revision, dtype=self.dtype, attn_implementation="sdpa",
            ).to(self.device).eval()
        except Exception as exc:
            raise EngineCannotLoadModel(
                f"infer.model {self.model_id!r} cannot be loaded as an image-text model by transformers "
                f"(AutoProcessor + AutoModelForImageTextToText): {type(exc).__name__}: {exc}") from exc
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.padding_side = "left"  # generate continues every row from its end
        self.image_token_id = self._image_token_id()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.schema = OutputSchema.load(settings.output_schema)
        self.generation_config = self._generation_config()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._prompts: dict[str, str] = {}
        self._init_queues()
        self._start_worker(lambda: self._serve_batches(self._process, self.batch_size), "processor-engine")

    def _image_token_id(self) -> int | None:
        """The id the processor expands into the model's image tokens (counted as the output's visual tokens)."""
        # The model's own id first: a processor's image_token_id may be the marker it expands (Gemma 3's <boi>).
        for owner, name in ((self.model.config, "image_token_id"), (self.model.config, "image_token_index"),
                            (self.processor, "image_token_id")):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
        return None

    def _prompt(self, instruction: str) -> str:
        if instruction not in self._prompts:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
            self._prompts[instruction] = self.processor.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)
        return self._prompts[instruction]

    def _request_problem(self, request: InferenceRequest) -> str | None:
        """Any size will do (the processor resizes); the image must still be RGB pixels."""
        image = request.image
        if getattr(image, "dtype", None) is None or image.dtype.name != "uint8" or image.ndim != 3 \
                or image.shape[2] != 3 or min(image.shape[:2]) < 1:
            return (f"image must be an H x W x 3 uint8 RGB array, got {type(image).__name__} "
                    f"{getattr(image, 'shape', None)}")
        return None

    def _run_batch(self, items: list[tuple[InferenceRequest, float]]) -> list:
        torch = self._torch
        requests = [request for request, _ in items]
        started, cpu_started = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            inputs = self.processor(text=[self._prompt(r.prompt) for r in requests],
                                    images=[[r.image] for r in requests], padding=True, return_tensors="pt")
            inputs = inputs.to(self.device)
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
            self._sync()
            processed = time.perf_counter()
            config = copy.copy(self.generation_config)
            config.max_new_tokens = max(r.max_new_tokens for r in requests)
            sequences = self.model.generate(**inputs, generation_config=config)
            self._sync()
        generated, cpu_generated = time.perf_counter(), time.process_time()
        input_ids = inputs["input_ids"]
        new_tokens = sequences[:, input_ids.shape[1]:].tolist()
        prompt_lengths = inputs["attention_mask"].sum(-1).tolist()
        visual = ((input_ids == self.image_token_id).sum(-1).tolist() if self.image_token_id is not None
                  else [0] * len(requests))
        per_batch = {"preprocess_ms": (processed - started) * 1e3, "generate_ms": (generated - processed) * 1e3,
                     "batch_ms": (generated - started) * 1e3}
        if self.device.startswith("cpu"):
            # The process's CPU time (all torch's threads, and a little of the runner's and its Kafka clients'): the
            # batch's cost whatever else shares the cores; as in the transformers engine.
            per_batch["batch_cpu_ms"] = (cpu_generated - cpu_started) * 1e3
        results = []
        for i, (request, submitted) in enumerate(items):
            tokens = self._trim(new_tokens[i], request.max_new_tokens)
            output = InferenceOutput(
                request_id=request.request_id, text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                prompt_tokens=int(prompt_lengths[i]), output_tokens=len(tokens), visual_tokens=int(visual[i]),
                embedding=None, timings_ms={"queue_ms": (started - submitted) * 1e3, **per_batch})
            results.append(with_schema(self.schema, output))
        return results
