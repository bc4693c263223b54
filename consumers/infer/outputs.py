"""What the inference runner publishes for one image: its description and embedding, or its dead letter."""

from __future__ import annotations

import time

from consumers.infer.engine import Engine, InferenceOutput
from consumers.infer.work import NO_META, Work
from schemas import Description, Embedding, now, source_coords
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import Output
from vlmstream.kafka.records import dead_letter_from_record


def timings_ms(work: Work, out: InferenceOutput) -> dict[str, float]:
    """The engine's own timings, plus the runner's view: queued, in the engine, in total, since produced."""
    t = time.monotonic()
    timings = {k: float(v) for k, v in (out.timings_ms or {}).items()}
    timings["queue_ms"] = round((work.submitted_at - work.polled_at) * 1000, 3)
    timings["engine_ms"] = round((t - work.submitted_at) * 1000, 3)
    timings["total_ms"] = round((t - work.polled_at) * 1000, 3)
    if work.record.timestamp and work.record.timestamp > 0:
        timings["since_produced_ms"] = round(max(0.0, time.time() * 1000 - work.record.timestamp), 3)
    if work.meta.decode_ms is not None:
        timings["decode_ms"] = float(work.meta.decode_ms)
    if work.meta.prepare_cpu_ms is not None:
        timings["prepare_cpu_ms"] = float(work.meta.prepare_cpu_ms)
    return timings


def described(settings: Settings, engine: Engine, work: Work, out: InferenceOutput,
              visual_tokens: int) -> list[Output]:
    """The description and, when asked for and given, the embedding. Raises SchemaError when one cannot be
    written."""
    meta, cfg = work.meta, settings.infer
    coords = source_coords(work.tp.topic, work.tp.partition, work.offset)
    description = Description(
        doc_id=meta.doc_id, image_index=meta.image_index, image_count=meta.image_count,
        source_uri=meta.source_uri or None, text=out.text, json=out.parsed_json,
        model=engine.model_id, revision=engine.revision, prompt_id=cfg.prompt_id,
        engine=engine.name, mode=engine.mode, prompt_tokens=out.prompt_tokens,
        output_tokens=out.output_tokens, visual_tokens=visual_tokens, timings_ms=timings_ms(work, out),
        metadata=dict(meta.metadata or {}), source=coords, created_at=now())
    outputs = [Output(settings.topics.descriptions, description.key(), description.encode(), description.headers())]
    if cfg.publish_embeddings and out.embedding is not None:
        embedding = Embedding.from_vector(
            out.embedding, doc_id=meta.doc_id, image_index=meta.image_index, image_count=meta.image_count,
            model=engine.model_id, grid_thw=tuple(meta.grid_thw), source=coords, created_at=now())
        outputs.append(Output(settings.topics.embeddings, embedding.key(), embedding.encode(), embedding.headers()))
    return outputs


def dead_letter(settings: Settings, work: Work, error_kind: str, detail: str, *, retriable: bool) -> Output:
    """The image's dead letter, carrying its record (for redrive) and the attempts it took."""
    meta = work.meta if work.meta is not NO_META else None
    letter = dead_letter_from_record(
        work.record, stage="infer", error_kind=error_kind, detail=detail, retriable=retriable,
        doc_id=meta.doc_id if meta else None, image_index=meta.image_index if meta else None,
        image_count=meta.image_count if meta else None, source_uri=meta.source_uri if meta else None,
        attempts=max(1, work.attempts))
    return Output(settings.topics.deadletter, letter.key(), letter.encode(), letter.headers())
