"""One immutable message type per topic, encoded with orjson and validated against the JSON Schema
files in ``schemas/json`` (the same files a consumer in another language uses).

Validation happens at the edges: ``decode_*`` validates everything read from Kafka, ``encode``
validates what a producer is about to publish. A failure raises ``SchemaError`` naming the field.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, ClassVar, TypeVar

import fastjsonschema
import numpy as np
import orjson

SCHEMA_VERSION = 1

# Header conventions (values are UTF-8). Every record carries its schema and its document's identity,
# so a consumer can route or skip without decoding the value.
HEADER_SCHEMA = "vlmstream-schema"  # e.g. "description/1"
HEADER_DOC_ID = "vlmstream-doc-id"
HEADER_IMAGE_INDEX = "vlmstream-image-index"
HEADER_META = "vlmstream-meta"  # image payloads only: the ImagePayload JSON; the value holds the pixels
HEADER_ATTEMPT = "vlmstream-attempt"
# Documents only: how many images the document names, so a backlog is counted in images (the unit of work) from the
# headers, without parsing the value.
HEADER_IMAGE_COUNT = "vlmstream-images"


class SchemaError(ValueError):
    """A message does not match its topic's schema. ``field`` names the offending field."""

    def __init__(self, schema: str, field_path: str, message: str):
        self.schema = schema
        self.field = field_path
        super().__init__(f"{schema}: {field_path}: {message}")


@lru_cache(maxsize=None)
def schema_document(name: str) -> dict[str, Any]:
    text = resources.files("schemas.json").joinpath(f"{name}.schema.json").read_text()
    return json.loads(text)


@lru_cache(maxsize=None)
def _validator(name: str):
    return fastjsonschema.compile(schema_document(name))


def validate(name: str, obj: Any) -> None:
    try:
        _validator(name)(obj)
    except fastjsonschema.JsonSchemaValueException as exc:
        # fastjsonschema names the path as "data.field[0]"; report it as "field[0]".
        path = (exc.name or "data").removeprefix("data").lstrip(".")
        message = exc.message.replace(exc.name or "data", path or "message", 1)
        if exc.rule == "pattern" and str(exc.rule_definition).startswith("^[^\\u0000-"):
            message = "contains a control character (newline, tab, NUL...)"
        if exc.rule == "required" and isinstance(exc.value, dict):
            missing = [key for key in exc.rule_definition if key not in exc.value]
            if missing:
                path = f"{path}.{missing[0]}" if path else missing[0]
                message = "is required"
        raise SchemaError(name, path or "(message)", message) from None


T = TypeVar("T", bound="Message")


MAX_METADATA_DEPTH = 32


@dataclass(frozen=True)
class Message:
    schema_name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        # JSON Schema cannot bound nesting, and orjson reads 1,024 levels but writes only ~254: metadata read from
        # a topic must be metadata every later hop can write again (an output that cannot be written stops its
        # consumer on the same record after every restart).
        if _deeper_than(getattr(self, "metadata", None), MAX_METADATA_DEPTH):
            raise SchemaError(self.schema_name, "metadata", f"nests deeper than {MAX_METADATA_DEPTH} levels")
        # The results stage waits for images 0 .. image_count-1: an index outside them would be described and
        # then lost from its document's result (or a document of zero images emitted complete).
        index, count = getattr(self, "image_index", None), getattr(self, "image_count", None)
        if index is not None and count is not None and not 0 <= index < count:
            raise SchemaError(self.schema_name, "image_index", f"{index} is not below image_count {count}")

    def to_dict(self) -> dict[str, Any]:
        data = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in _KEEP_NONE:
                continue
            data[f.name] = value
        return data

    def encode(self, validate_output: bool = True) -> bytes:
        data = self.to_dict()
        if validate_output:
            validate(self.schema_name, data)
        try:
            return orjson.dumps(data)
        except TypeError as exc:  # orjson.JSONEncodeError: text that is not UTF-8, nesting past its limit
            why = ("a text in it is not valid UTF-8 (a file, folder or column name in another encoding?)"
                   if "surrogates" in str(exc) else f"cannot be written as JSON: {exc}")
            raise SchemaError(self.schema_name, "(message)", why) from None

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        validate(cls.schema_name, data)
        names = {f.name for f in dataclasses.fields(cls)}
        integers = _integer_fields(cls.schema_name)
        return cls(**{k: _freeze(_as_int(v) if k in integers else v) for k, v in data.items() if k in names})

    @classmethod
    def decode(cls: type[T], raw: bytes | str | None) -> T:
        if raw is None:
            raise SchemaError(cls.schema_name, "(message)", "empty record value")
        try:
            data = loads_exact(raw)
        except ValueError as exc:  # orjson's JSONDecodeError is one
            raise SchemaError(cls.schema_name, "(message)", f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise SchemaError(cls.schema_name, "(message)", "must be a JSON object")
        return cls.from_dict(data)

    def headers(self) -> list[tuple[str, bytes]]:
        hdrs = [(HEADER_SCHEMA, f"{self.schema_name}/{SCHEMA_VERSION}".encode())]
        doc_id = getattr(self, "doc_id", None)
        if doc_id is not None:
            hdrs.append((HEADER_DOC_ID, doc_id.encode()))
        image_index = getattr(self, "image_index", None)
        if image_index is not None:
            hdrs.append((HEADER_IMAGE_INDEX, str(image_index).encode()))
        return hdrs


_KEEP_NONE = {"claim_check", "json", "revision", "mode"}


@lru_cache(maxsize=None)
def _integer_fields(name: str) -> frozenset[str]:
    """Top-level fields the schema types as integers, or as arrays of them."""
    out = set()
    for key, spec in schema_document(name).get("properties", {}).items():
        items = spec.get("items") if isinstance(spec.get("items"), dict) else {}
        if "integer" in (spec.get("type"), items.get("type")):
            out.add(key)
    return frozenset(out)


def _as_int(value: Any) -> Any:
    # JSON Schema counts 56.0 as an integer, and other writers send one so: it must reach numpy shapes, tensor
    # grids and our own outputs as 56, not as a float (validation has already ruled out 56.5).
    if isinstance(value, float):
        return int(value)
    if isinstance(value, list):
        return [int(v) if isinstance(v, float) else v for v in value]
    return value


def _freeze(value: Any) -> Any:
    # Lists become tuples so messages stay hashable and immutable; dicts stay dicts (metadata).
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


# 2**64 has 20 digits: orjson reads every shorter integer exactly, and a longer one as a float, silently.
_LONG_DIGIT_RUN = re.compile(rb"\d{20,}")


def loads_exact(raw: bytes | str) -> Any:
    """orjson.loads, except that an integer beyond 64 bits raises ValueError: orjson would read it as a float (a
    changed id or count nobody notices), and no hop could write it again."""
    data = orjson.loads(raw)
    if _LONG_DIGIT_RUN.search(raw.encode() if isinstance(raw, str) else raw):
        if _has_wide_int(json.loads(raw)):
            raise ValueError("an integer beyond 64 bits (quote it as a string)")
    return data


def _has_wide_int(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(2**63) <= value < 2**64
    if isinstance(value, dict):
        return any(_has_wide_int(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_wide_int(v) for v in value)
    return False


def now() -> float:
    return round(time.time(), 3)


def source_coords(topic: str, partition: int, offset: int) -> dict[str, Any]:
    return {"topic": topic, "partition": partition, "offset": offset}


@dataclass(frozen=True)
class DocumentRef(Message):
    schema_name: ClassVar[str] = "document"
    doc_id: str
    image_uris: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    published_at: float | None = None

    def key(self) -> bytes:
        return self.doc_id.encode()

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["image_uris"] = list(self.image_uris)
        return data

    def headers(self) -> list[tuple[str, bytes]]:
        return super().headers() + [(HEADER_IMAGE_COUNT, str(len(self.image_uris)).encode())]


def _deeper_than(value: Any, limit: int) -> bool:
    if not isinstance(value, (dict, list, tuple)):
        return False
    if limit <= 0:
        return True
    children = value.values() if isinstance(value, dict) else value
    return any(_deeper_than(child, limit - 1) for child in children)


@dataclass(frozen=True)
class ImagePayload(Message):
    """Metadata of one preprocessed image. The pixels travel as the record value (see ``HEADER_META``)."""

    schema_name: ClassVar[str] = "image_payload"
    doc_id: str
    image_index: int
    image_count: int
    source_uri: str
    codec: str
    width: int
    height: int
    grid_thw: tuple[int, int, int]
    orig_width: int | None = None
    orig_height: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    payload_bytes: int | None = None
    claim_check: str | None = None
    source_format: str | None = None
    decode_ms: float | None = None
    prepare_cpu_ms: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] | None = None
    created_at: float | None = None

    def key(self) -> bytes:
        return image_key(self.doc_id, self.image_index)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["grid_thw"] = list(self.grid_thw)
        return data

    def headers(self) -> list[tuple[str, bytes]]:
        return super().headers() + [(HEADER_META, self.encode())]

    @property
    def visual_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // 4  # every family merges 2x2 patches into one LLM token


def image_key(doc_id: str, image_index: int) -> bytes:
    return f"{doc_id}/{image_index}".encode()


@dataclass(frozen=True)
class Description(Message):
    schema_name: ClassVar[str] = "description"
    doc_id: str
    image_index: int
    image_count: int
    text: str
    model: str
    prompt_id: str
    engine: str
    source_uri: str | None = None
    json: Any = None
    revision: str | None = None
    mode: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    visual_tokens: int | None = None
    timings_ms: dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] | None = None
    created_at: float | None = None

    def key(self) -> bytes:
        return self.doc_id.encode()


@dataclass(frozen=True)
class Embedding(Message):
    schema_name: ClassVar[str] = "embedding"
    doc_id: str
    image_index: int
    image_count: int
    model: str
    dim: int
    dtype: str
    vector_b64: str
    pooling: str = "mean"
    grid_thw: tuple[int, int, int] | None = None
    source: dict[str, Any] | None = None
    created_at: float | None = None

    def key(self) -> bytes:
        return self.doc_id.encode()

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.grid_thw is not None:
            data["grid_thw"] = list(self.grid_thw)
        return data

    @classmethod
    def from_vector(cls, vector: np.ndarray, **kwargs: Any) -> "Embedding":
        vector = np.asarray(vector)
        dtype = "float32" if vector.dtype == np.float32 else "float16"
        data = vector.astype(f"<{'f4' if dtype == 'float32' else 'f2'}").tobytes()
        return cls(dim=int(vector.shape[-1]), dtype=dtype, vector_b64=base64.b64encode(data).decode(), **kwargs)

    def vector(self) -> np.ndarray:
        dt = "<f4" if self.dtype == "float32" else "<f2"
        return np.frombuffer(base64.b64decode(self.vector_b64), dtype=dt)


@dataclass(frozen=True)
class DeadLetter(Message):
    schema_name: ClassVar[str] = "dead_letter"
    stage: str
    error_kind: str
    detail: str
    retriable: bool = False
    doc_id: str | None = None
    image_index: int | None = None
    image_count: int | None = None
    source_uri: str | None = None
    source: dict[str, Any] | None = None
    attempts: int = 1
    original_key_b64: str | None = None
    original_value_b64: str | None = None
    original_headers: dict[str, str] | None = None
    original_headers_b64: tuple[tuple[str, str | None], ...] | None = None
    created_at: float | None = None

    def key(self) -> bytes | None:
        return self.doc_id.encode() if self.doc_id is not None else None


ORIGINAL_VALUE_CAP = 1024 * 1024


def b64_or_none(raw: bytes | None, cap: int = ORIGINAL_VALUE_CAP) -> str | None:
    if raw is None:
        return None
    return base64.b64encode(raw[:cap]).decode()


@dataclass(frozen=True)
class DocumentResult(Message):
    schema_name: ClassVar[str] = "document_result"
    doc_id: str
    image_count: int
    succeeded: int
    failed: int
    images: tuple[dict[str, Any], ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    completed_at: float | None = None

    def key(self) -> bytes:
        return self.doc_id.encode()

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["images"] = [dict(i) for i in self.images]
        return data


@dataclass(frozen=True)
class DocumentSummary(Message):
    """One document's structured answer (topic ``summaries``, compacted by doc_id). ``result`` says which version of
    the document's result it answers: where that result was read (topic, partition, offset), when it completed and a
    fingerprint of what it said."""

    schema_name: ClassVar[str] = "document_summary"
    doc_id: str
    answer: dict[str, Any]
    answer_schema_id: str
    result: dict[str, Any]
    model: str
    engine: str
    prompt_id: str
    revision: str | None = None
    images_used: tuple[int, ...] = ()
    cut: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    timings_ms: dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float | None = None

    def key(self) -> bytes:
        return self.doc_id.encode()

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["images_used"] = list(self.images_used)
        return data


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.schema_name: cls for cls in (DocumentRef, ImagePayload, Description, Embedding, DeadLetter, DocumentResult,
                                     DocumentSummary)
}


def header_value(headers: list[tuple[str, bytes]] | None, name: str) -> bytes | None:
    for key, value in headers or ():
        if key == name:
            return value
    return None


def document_image_count(headers: list[tuple[str, bytes]] | None, value: bytes | None) -> int | None:
    """Images a documents-topic record names: its ``vlmstream-images`` header, or (a writer that does not set it)
    the length of ``image_uris`` in its value; None for a record that is no document (decode dead-letters it: no
    image)."""
    raw = header_value(headers, HEADER_IMAGE_COUNT)
    if raw is not None:
        try:
            count = int(raw)
        except ValueError:
            count = -1
        if count >= 0:
            return count
    try:
        data = orjson.loads(value) if value is not None else None
    except ValueError:
        return None
    uris = data.get("image_uris") if isinstance(data, dict) else None
    return len(uris) if isinstance(uris, list) else None


def decode_image_payload(headers: list[tuple[str, bytes]] | None) -> ImagePayload:
    raw = header_value(headers, HEADER_META)
    if raw is None:
        raise SchemaError("image_payload", "(headers)", f"missing header {HEADER_META!r}")
    return ImagePayload.decode(raw)
