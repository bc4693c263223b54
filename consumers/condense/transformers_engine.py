"""The transformers condense engine: a causal language model (or a vision-language checkpoint's language model, text
only) with ``generate``, on CPU (tests, CI, small deployments) or CUDA, its answers constrained to the answer schema
by ``constrained.ConstrainedDecoder`` (a logits processor: one decoder per document of the batch).

One background thread owns the model and takes whatever is queued (up to ``condense.batch_size``), never waiting for
a full batch. Schemas outside the decoder's subset are refused at start, naming ``condense.answer_schema``.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

from consumers.condense.constrained import (Allowed, ConstrainedDecoder, Forced, TokenTable, UnsupportedSchema,
                                            compile_plan)
from consumers.condense.engine import CondenseFailure, CondenseOutput, CondenseRequest, is_multimodal
from consumers.condense.stage import AnswerSchema
from vlmstream.config import CondenseSettings
from vlmstream.queued_engine import QueuedEngine

log = logging.getLogger(__name__)


def answer_decoder(settings: CondenseSettings, answer_schema: AnswerSchema, table: TokenTable) -> ConstrainedDecoder:
    """The decoder for the answer schema, or a ValueError naming the setting when the schema is outside its subset."""
    try:
        plan = compile_plan(answer_schema.schema, max_string_chars=settings.max_string_chars,
                            max_array_items=settings.max_array_items)
        return ConstrainedDecoder(plan, table)
    except UnsupportedSchema as exc:
        raise ValueError(f"condense.answer_schema ({answer_schema.schema_id}): {exc}. The transformers engine "
                         f"enforces an object of string, string-enum, boolean, integer, number and array-of-string "
                         f"properties (consumers/condense/constrained.py); other schemas need condense.engine=vllm"
                         ) from None


class _Constrain:
    """A logits processor: row i of the batch follows decoder i; a finished answer may only end (EOS)."""

    def __init__(self, decoders: list[ConstrainedDecoder], eos: int):
        self.steps = [d.steps() for d in decoders]
        self.done = [False] * len(decoders)
        self.eos = eos
        self.first = True

    def __call__(self, input_ids, scores):
        import torch

        for row, steps in enumerate(self.steps):
            step = None
            if not self.done[row]:
                try:
                    step = next(steps) if self.first else steps.send(int(input_ids[row, -1]))
                except StopIteration:
                    self.done[row] = True
            keep = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
            if step is None:
                keep[self.eos] = True
            elif isinstance(step, Forced):
                keep[step.token] = True
            else:
                assert isinstance(step, Allowed)
                keep = step.mask[:scores.shape[1]].to(scores.device)
            scores[row] = scores[row].masked_fill(~keep, float("-inf"))
        self.first = False
        return scores


class TransformersCondenseEngine(QueuedEngine):
    engine_label = "transformers condense engine"
    name = "transformers"

    def __init__(self, model_path: str | Path, settings: CondenseSettings, answer_schema: AnswerSchema,
                 device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        self._torch = torch
        self.settings = settings
        self.model_id = settings.model or str(model_path)
        self.revision = settings.revision
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if settings.dtype in ("", "auto"):
            dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        else:
            dtype = getattr(torch, settings.dtype)
        self.batch_size = settings.batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), revision=settings.revision)
        # A vision-language checkpoint's own class runs its language model on text alone (no image tokens).
        auto = AutoModelForImageTextToText if is_multimodal(model_path) else AutoModelForCausalLM
        self.model = auto.from_pretrained(str(model_path), revision=settings.revision, dtype=dtype,
                                          attn_implementation="sdpa").to(self.device).eval()
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.decoder = answer_decoder(settings, answer_schema, TokenTable(self.tokenizer, vocab))
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = self.model.generation_config.eos_token_id
            eos = eos[0] if isinstance(eos, list) else eos
        self.eos = int(eos)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        log.info("condense: transformers on %s, answers bounded to %d tokens by the answer schema", self.device,
                 self.decoder.max_tokens)
        self._init_queues()
        self._start_worker(lambda: self._serve_batches(self._run_splitting, self.batch_size), "condense-transformers")

    def close(self) -> None:
        if not self._stop_worker():
            return
        self.model = None
        gc.collect()
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()

    def _run_splitting(self, items: list[tuple[CondenseRequest, float]]) -> list:
        torch = self._torch
        try:
            return self._run_batch(items)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            if len(items) == 1:
                return [CondenseFailure(items[0][0].request_id, "out_of_memory", str(exc)[:2000], retriable=False)]
        except Exception as exc:  # noqa: BLE001 - one document's failure is a value
            if "CUDA error" in str(exc):
                raise
            if len(items) == 1:
                return [CondenseFailure(items[0][0].request_id, "condense_error", f"{type(exc).__name__}: {exc}")]
        # Run the documents alone so the one that fails does not take its batch-mates with it.
        return [result for item in items for result in self._run_splitting([item])]

    def _run_batch(self, items: list[tuple[CondenseRequest, float]]) -> list[Any]:
        torch = self._torch
        started, cpu_started = time.perf_counter(), time.process_time()
        rows = [request.prompt_ids for request, _ in items]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row):] = torch.tensor(row)
            attention[i, width - len(row):] = 1
        constrain = _Constrain([self.decoder] * len(rows), self.eos)
        sampling = ({"do_sample": True, "temperature": self.settings.temperature} if self.settings.temperature > 0
                    else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        with torch.inference_mode():
            sequences = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                # The answer schema bounds the answer (every content token adds a character); +1 for the EOS.
                max_new_tokens=self.decoder.max_tokens + 1,
                logits_processor=[constrain], eos_token_id=self.eos, pad_token_id=self.pad, **sampling)
        generated, cpu_generated = time.perf_counter(), time.process_time()
        timings = {"generate_ms": (generated - started) * 1e3, "batch_documents": float(len(items))}
        if self.device.startswith("cpu"):
            # The process's CPU time (all torch's threads, a little of the runner's): the batch's cost whatever else
            # shares the cores, as the inference engines report it.
            timings["generate_cpu_ms"] = (cpu_generated - cpu_started) * 1e3
        results = []
        for i, (request, submitted) in enumerate(items):
            tokens = sequences[i, width:].tolist()
            ended = self.eos in tokens
            if ended:
                tokens = tokens[:tokens.index(self.eos) + 1]
            results.append(CondenseOutput(
                request_id=request.request_id, text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                prompt_tokens=len(request.prompt_ids), output_tokens=len(tokens),
                finish_reason="stop" if ended else "length",
                timings_ms={"queue_ms": (started - submitted) * 1e3, **timings}))
        return results
