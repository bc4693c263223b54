"""Every schema round-trips and rejects invalid messages with a message naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas import (DeadLetter, Description, DocumentRef, DocumentResult, Embedding, ImagePayload, SchemaError,
                     decode_image_payload, schema_document)

EXAMPLES = [
    DocumentRef(doc_id="doc-1", image_uris=("a.jpg", "https://example.com/b.png"), metadata={"k": "v"},
                source="manifest.jsonl:1", published_at=1.0),
    ImagePayload(doc_id="doc-1", image_index=0, image_count=2, source_uri="a.jpg", codec="jpeg", width=448,
                 height=224, grid_thw=(1, 16, 32), orig_width=1000, orig_height=500, min_pixels=3136,
                 max_pixels=12845056, payload_bytes=1234, decode_ms=12.5, prepare_cpu_ms=11.0,
                 source={"topic": "t", "partition": 0, "offset": 5}),
    Description(doc_id="doc-1", image_index=1, image_count=2, text="a cat", model="tiny", prompt_id="p1",
                engine="transformers", prompt_tokens=10, output_tokens=3, visual_tokens=128,
                timings_ms={"generate": 1.5}),
    Embedding.from_vector(np.arange(8, dtype=np.float16), doc_id="doc-1", image_index=0, image_count=2,
                          model="tiny", grid_thw=(1, 16, 32)),
    DeadLetter(stage="decode", error_kind="decode_truncated", detail="image file is truncated", doc_id="doc-1",
               image_index=1, image_count=2, source={"topic": "t", "partition": 0, "offset": 7}),
    DocumentResult(doc_id="doc-1", image_count=2, succeeded=1, failed=1,
                   images=({"image_index": 0, "status": "ok", "text": "a cat"},
                           {"image_index": 1, "status": "failed", "stage": "decode",
                            "error_kind": "decode_truncated", "detail": "truncated"})),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert type(message).decode(message.encode()) == message


def test_embedding_vector_round_trip():
    vec = np.linspace(-1, 1, 3584).astype(np.float16)
    emb = Embedding.from_vector(vec, doc_id="d", image_index=0, image_count=1, model="m")
    back = Embedding.decode(emb.encode())
    assert back.dim == 3584 and back.dtype == "float16"
    np.testing.assert_array_equal(back.vector(), vec)


def test_image_payload_meta_travels_in_headers():
    payload = EXAMPLES[1]
    assert decode_image_payload(payload.headers()) == payload
    assert payload.key() == b"doc-1/0"
    assert payload.visual_tokens == 16 * 32 // 4


@pytest.mark.parametrize("cls,data,field", [
    (DocumentRef, {"schema_version": 1, "image_uris": ["a"]}, "doc_id"),
    (DocumentRef, {"schema_version": 1, "doc_id": "d", "image_uris": []}, "image_uris"),
    (DocumentRef, {"schema_version": 1, "doc_id": "d", "image_uris": [5]}, "image_uris[0]"),
    (DocumentRef, {"schema_version": 2, "doc_id": "d", "image_uris": ["a"]}, "schema_version"),
    (ImagePayload, {**EXAMPLES[1].to_dict(), "codec": "gif"}, "codec"),
    (ImagePayload, {**EXAMPLES[1].to_dict(), "grid_thw": [1, 2]}, "grid_thw"),
    (Description, {**EXAMPLES[2].to_dict(), "image_index": -1}, "image_index"),
    (Embedding, {**EXAMPLES[3].to_dict(), "dtype": "int8"}, "dtype"),
    (DeadLetter, {"schema_version": 1, "stage": "nowhere", "error_kind": "x", "detail": "y"}, "stage"),
    (DocumentResult, {**EXAMPLES[5].to_dict(), "images": [{"image_index": 0, "status": "maybe"}]},
     "images[0].status"),
    # An index outside its document's count would be described, then lost from the document's result.
    (ImagePayload, {**EXAMPLES[1].to_dict(), "image_index": 2}, "image_index"),
    (ImagePayload, {**EXAMPLES[1].to_dict(), "image_count": 0}, "image_index"),
    # Metadata nested past what orjson writes (~254) would make every output for it unwritable.
    (ImagePayload, {**EXAMPLES[1].to_dict(), "metadata": {"k": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}},
     "metadata"),
])
def test_invalid_messages_name_the_field(cls, data, field):
    with pytest.raises(SchemaError) as info:
        cls.decode(json.dumps(data).encode())
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1,2]", None])
def test_garbage_is_a_schema_error(raw):
    with pytest.raises(SchemaError):
        DocumentRef.decode(raw)


def test_unknown_fields_rejected():
    data = {**EXAMPLES[0].to_dict(), "surprise": 1}
    with pytest.raises(SchemaError):
        DocumentRef.decode(json.dumps(data).encode())


def test_schema_files_are_standalone_2020_12():
    import jsonschema

    for name in ("document", "image_payload", "description", "embedding", "dead_letter", "document_result"):
        doc = schema_document(name)
        assert doc["$schema"].endswith("2020-12/schema")
        jsonschema.Draft202012Validator.check_schema(doc)
    # A validator in another language sees the same verdicts: jsonschema (not our fastjsonschema) agrees.
    for message in EXAMPLES:
        jsonschema.Draft202012Validator(schema_document(message.schema_name)).validate(message.to_dict())


def test_documents_from_other_clients_may_leave_out_the_schema_version():
    """The input topic is written by anyone's producer (kcat, Java, a shell script): no version means version 1.
    Every topic the pipeline writes keeps it required."""
    document = DocumentRef.decode(b'{"doc_id": "d", "image_uris": ["a.jpg"]}')
    assert document == DocumentRef(doc_id="d", image_uris=("a.jpg",))
    assert json.loads(document.encode())["schema_version"] == 1
    with pytest.raises(SchemaError) as info:
        Description.decode(json.dumps({k: v for k, v in EXAMPLES[2].to_dict().items() if k != "schema_version"}))
    assert info.value.field == "schema_version"


def test_integral_floats_in_integer_fields_arrive_as_integers():
    """JSON Schema counts 56.0 as an integer and other writers send one so; shapes and tensor grids need ints."""
    payload = ImagePayload.decode(json.dumps({**EXAMPLES[1].to_dict(), "width": 448.0, "grid_thw": [1.0, 16.0, 32.0]}))
    assert payload == EXAMPLES[1] and type(payload.width) is int and all(type(v) is int for v in payload.grid_thw)
    with pytest.raises(SchemaError, match="width"):
        ImagePayload.decode(json.dumps({**EXAMPLES[1].to_dict(), "width": 448.5}))
