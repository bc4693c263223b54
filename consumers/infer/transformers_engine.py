"""The transformers engine: any Qwen family (vlmstream/models/) with plain ``generate``, on CPU (tests, CI, small
deployments) or CUDA.

One background thread owns the model. It takes whatever is queued (up to ``batch_size``, never waiting
for a full batch), encodes the batch's images in one vision-tower forward, and runs one batched greedy
``generate`` in which the model takes that tower output as its pre-encoded image features (``mm_encoder_outputs``):
the model's own forward places the tokens and, for Qwen3-VL, adds the DeepStack levels to its first layers. The
vision output is kept, so the embedding published on the embeddings topic is the mean of exactly the
tokens the language model saw: no second vision run.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from pathlib import Path
from typing import Sequence

from consumers.infer.engine import (EngineCannotLoadModel, InferenceFailure, InferenceOutput, InferenceRequest,
                                    QueuedEngine, limit_cpu_use)
from consumers.infer.prompts import OutputSchema, PromptBuilder, with_schema
from consumers.infer.vision.encoder import VisionEncoder
from consumers.infer.vision.outputs import mean_pool_each
from consumers.infer.vision.pixels import patchify_batch, request_problem
from vlmstream.config import InferSettings
from vlmstream.models.registry import family_of

log = logging.getLogger(__name__)



def resolve_dtype(name: str, device: str):
    import torch

    if name in ("", "auto"):
        # bf16 halves memory and runs on tensor cores; CPUs without AMX run it slower than fp32.
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
                "fp32": torch.float32}[name]
    except KeyError:
        raise ValueError(f"infer.dtype {name!r} is not one of auto, bfloat16, float16, float32") from None


def _is_fatal(exc: BaseException) -> bool:
    """A CUDA fault poisons the context: every later call fails too, so the engine is dead, not the request."""
    import torch

    text = str(exc)
    return isinstance(exc, torch.AcceleratorError) or "CUDA error" in text or "device-side assert" in text


class TransformersEngine(QueuedEngine):
    engine_label = "transformers engine"
    name = "transformers"
    mode = None
    ignore_eos = False

    def __init__(self, model_path: str | Path, settings: InferSettings, device: str | None = None,
                 vision_attention: str = "auto", ignore_eos: bool = False):
        """``ignore_eos``: every output runs to its token budget (guided ones excepted), for benchmarks that compare
        at one output length."""
        import torch
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        self.ignore_eos = ignore_eos
        self.settings = settings
        self.model_id = settings.model or str(model_path)
        self.revision = settings.revision
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        limit_cpu_use(settings, self.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.batch_size = max(1, settings.batch_size)
        self.step_tokens = None  # no per-step token budget: a batch is whatever is queued, up to batch_size
        self._torch = torch

        # The family (patch size, normalisation, tower) from the checkpoint's config.json: raises naming infer.model
        # before anything loads when no family describes it.
        self.family = family_of(model_path)
        if not self.family.exact_size:
            raise ValueError(f"infer.model {self.model_id!r} has no model family (the generic path): its own processor "
                             "runs it, in consumers.infer.processor_engine (make_engine picks it)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), revision=settings.revision)
            self.model = AutoModelForImageTextToText.from_pretrained(
                str(model_path), revision=settings.revision, dtype=self.dtype, attn_implementation="sdpa",
            ).to(self.device).eval()
        except Exception as exc:
            raise EngineCannotLoadModel(
                f"infer.model {self.model_id!r} cannot be loaded by transformers: {type(exc).__name__}: {exc}") from exc
        self.encoder = VisionEncoder(self.model.model.visual, self.device, self.dtype, attention=vision_attention,
                                     family=self.family)
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        self._features_class = BaseModelOutputWithPooling
        self.image_token_id = int(self.model.config.image_token_id)
        self.pad_token_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                             else self.tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        self.prompts = PromptBuilder(self.tokenizer, self.family)
        self.schema = OutputSchema.load(settings.output_schema)
        self.generation_config = self._generation_config()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._prompt_ids: dict[str, tuple[list[int], list[int]]] = {}

        self._init_queues()
        self._start_worker(lambda: self._serve_batches(self._process, self.batch_size), "transformers-engine")

    # ----------------------------------------------------------------------------- Engine protocol

    def close(self) -> None:
        if not self._stop_worker():
            return
        self.encoder = None
        self.model = None
        gc.collect()
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()

    # ----------------------------------------------------------------------------- worker thread

    def _request_problem(self, request: InferenceRequest) -> str | None:
        """Why this engine cannot take the request's image as it is, or None."""
        return request_problem(request.image, request.grid_thw, self.family)

    def _process(self, batch: list[tuple[InferenceRequest, float]]) -> list:
        results: list = []
        valid = []
        for request, submitted in batch:
            problem = self._request_problem(request)
            if problem:
                results.append(InferenceFailure(request.request_id, "invalid_request", problem, retriable=False))
            else:
                valid.append((request, submitted))
        if valid:
            results += self._run_splitting(valid)
        return results

    def _run_splitting(self, items: list[tuple[InferenceRequest, float]]) -> list:
        torch = self._torch
        try:
            return self._run_batch(items)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
            if len(items) == 1:
                request = items[0][0]
                return [InferenceFailure(request.request_id, "out_of_memory",
                                         f"{request.image.shape[1]}x{request.image.shape[0]} image alone does not "
                                         f"fit: {exc}", retriable=False)]
            half = len(items) // 2
            log.warning("out of memory on a batch of %d; retrying as %d + %d", len(items), half, len(items) - half)
            return self._run_splitting(items[:half]) + self._run_splitting(items[half:])
        except Exception as exc:
            if _is_fatal(exc):
                raise
            if len(items) == 1:
                return [InferenceFailure(items[0][0].request_id, "inference_error", f"{type(exc).__name__}: {exc}")]
            # Run the requests alone so the one that fails does not take its batch-mates with it.
            log.warning("batch of %d failed (%r); retrying its requests one by one", len(items), exc)
            return [result for item in items for result in self._run_splitting([item])]

    def _run_batch(self, items: list[tuple[InferenceRequest, float]]) -> list:
        torch = self._torch
        requests = [request for request, _ in items]
        started, cpu_started = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            pixel_values, grid_thw = patchify_batch([r.image for r in requests], self.device, self.dtype, self.family)
            self._sync()
            patched, cpu_patched = time.perf_counter(), time.process_time()
            image_tokens = self.encoder.encode_patches(pixel_values, grid_thw)
            self._sync()
            encoded, cpu_encoded = time.perf_counter(), time.process_time()

            input_ids, attention_mask = self._prompt_batch(requests, [t.shape[0] for t in image_tokens])
            image_mask = input_ids == self.image_token_id
            config = copy.copy(self.generation_config)
            config.max_new_tokens = max(r.max_new_tokens for r in requests)
            # The tower's output goes in as transformers' pre-encoded image features (`mm_encoder_outputs`), so
            # generate never runs the model's own tower; the grid still goes in for the model's rotary positions.
            sequences = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                mm_encoder_outputs={"image": self._image_features(image_tokens)},
                image_grid_thw=grid_thw.to(self.device), mm_token_type_ids=image_mask.int(),
                generation_config=config,
            )
            self._sync()
        generated, cpu_generated = time.perf_counter(), time.process_time()

        new_tokens = sequences[:, input_ids.shape[1]:].tolist()
        prompt_lengths = attention_mask.sum(-1).tolist()
        per_batch = {
            "preprocess_ms": (patched - started) * 1e3,
            "vision_ms": (encoded - patched) * 1e3,
            "generate_ms": (generated - encoded) * 1e3,
            "batch_ms": (generated - started) * 1e3,
        }
        if self.device.startswith("cpu"):
            # What the batch cost the cores, whatever else ran on them meanwhile (an estimate's short sample runs
            # beside busy decoders, a long job less so): the process's CPU time, so torch's threads all count; the
            # process's other threads (the runner, its Kafka clients) add their little share too. On an
            # accelerator the process's CPU time says nothing of the batch's cost: the wall times above do.
            per_batch["vision_cpu_ms"] = (cpu_encoded - cpu_patched) * 1e3
            per_batch["batch_cpu_ms"] = (cpu_generated - cpu_started) * 1e3
        wanted = [i for i, (request, _) in enumerate(items) if request.want_embedding]
        embeddings = dict(zip(wanted, mean_pool_each([image_tokens[i] for i in wanted], self.encoder.embedding_width)))
        results = []
        for i, (request, submitted) in enumerate(items):
            tokens = self._trim(new_tokens[i], request.max_new_tokens)
            output = InferenceOutput(
                request_id=request.request_id,
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                prompt_tokens=int(prompt_lengths[i]),
                output_tokens=len(tokens),
                visual_tokens=int(image_tokens[i].shape[0]),
                embedding=embeddings.get(i),
                timings_ms={"queue_ms": (started - submitted) * 1e3, **per_batch},
            )
            results.append(with_schema(self.schema, output))
        return results

    # ----------------------------------------------------------------------------- helpers

    def _image_features(self, image_embeds: Sequence):
        """The encoder's output for this batch as the model's ``get_image_features`` returns it: per image the main
        merger's tokens (``pooler_output``) and, per DeepStack level (Qwen3-VL), each image's tokens of that level
        (``deepstack_features``), split back out of the encoder's concatenated ``image_embeds``."""
        width, levels = self.encoder.embedding_width, self.encoder.deepstack_levels
        features = self._features_class(pooler_output=tuple(t[:, :width] for t in image_embeds))
        if levels:
            features["deepstack_features"] = [tuple(t[:, width * (i + 1):width * (i + 2)] for t in image_embeds)
                                              for i in range(levels)]
        return features

    @property
    def _ignore_eos(self) -> bool:
        # Not with an output schema: the document must be able to end (as in the vLLM engine).
        return self.ignore_eos and self.schema is None

    def _generation_config(self):
        config = copy.deepcopy(self.model.generation_config)
        config.do_sample = self.settings.temperature > 0
        if config.do_sample:
            config.temperature = self.settings.temperature
        else:  # the checkpoint's sampling defaults (top_k, top_p) would only draw warnings under greedy
            config.temperature, config.top_p, config.top_k = None, None, None
        config.pad_token_id = self.pad_token_id
        if self._ignore_eos:
            config.eos_token_id = None
        return config

    def _prompt_batch(self, requests: Sequence[InferenceRequest], visual_tokens: Sequence[int]):
        """Token ids for the batch, left-padded. The image pad run is built as ids, not tokenised as text:
        a 12.8 MP image is 16k pad tokens."""
        torch = self._torch
        rows = []
        for request, n in zip(requests, visual_tokens):
            before, after = self._prompt_parts(request.prompt)
            rows.append(before + [self.image_token_id] * n + after)
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row):] = torch.tensor(row)
            attention_mask[i, width - len(row):] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _prompt_parts(self, instruction: str) -> tuple[list[int], list[int]]:
        if instruction not in self._prompt_ids:
            before, after = self.prompts.prompt(instruction).split(self.family.image_pad, 1)
            # Special tokens delimit pre-tokenisation, so the two halves tokenise as they would joined.
            self._prompt_ids[instruction] = (self.tokenizer.encode(before, add_special_tokens=False),
                                             self.tokenizer.encode(after, add_special_tokens=False))
        return self._prompt_ids[instruction]

    def _trim(self, tokens: list[int], limit: int) -> list[int]:
        tokens = tokens[:limit]
        if not self._ignore_eos:
            for i, token in enumerate(tokens):
                if token in self.eos_ids:
                    return tokens[: i + 1]  # counted like vLLM counts it: the stop token is an output token
        return tokens

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self._torch.cuda.synchronize()
