"""The condense stage without Kafka: the schema-constrained decoder (valid JSON of every supported type, bounded
length, refused schemas named), the cut rule for long documents, and prompt building on the tiny model's tokenizer."""

from __future__ import annotations

import json
import random

import fastjsonschema
import pytest
import torch

from consumers.condense.constrained import (ConstrainedDecoder, Forced, TokenTable, UnsupportedSchema,
                                            compile_plan)
from consumers.condense.stage import (CUT_MARKER, DEFAULT_ANSWER_SCHEMA, AnswerSchema, AnswerViolation,
                                      CondensePrompt, CondenseProblem, Condenser, cut_to_budget, load_prompt_template)
from consumers.condense.transformers_engine import answer_decoder
from consumers.infer.tiny_model import default_tiny_model_dir
from schemas import DocumentResult
from vlmstream.config import CondenseSettings

pytestmark = pytest.mark.model

EVERY_TYPE = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "minLength": 2, "maxLength": 12},
        "free": {"type": "string"},
        "grade": {"enum": ["a", "ab", "b", "unknown"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "small": {"type": "integer", "minimum": 0, "maximum": 7},
        "weight": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "colours": {"type": "array", "items": {"enum": ["red", "green"]}},
    },
    "required": ["kind", "grade", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_tiny_model_dir()))


@pytest.fixture(scope="module")
def table(tokenizer) -> TokenTable:
    return TokenTable(tokenizer, 151936)


def run_decoder(decoder: ConstrainedDecoder, choose) -> list[int]:
    """Drive the decoder as generate would, ``choose(allowed ids)`` standing in for the model."""
    tokens: list[int] = []
    steps = decoder.steps()
    step = next(steps)
    while True:
        token = step.token if isinstance(step, Forced) else choose(torch.nonzero(step.mask).flatten().tolist())
        tokens.append(token)
        try:
            step = steps.send(token)
        except StopIteration:
            return tokens


def test_every_supported_type_decodes_to_valid_bounded_json(tokenizer, table):
    decoder = ConstrainedDecoder(compile_plan(EVERY_TYPE, max_string_chars=20, max_array_items=4), table)
    validate = fastjsonschema.compile(EVERY_TYPE)
    structure = {table.char(c) for c in '"],}.-'}
    seen: dict[str, set] = {"grade": set(), "ok": set(), "tags": set()}
    for seed in range(80):
        rng = random.Random(seed)
        # A model that ends things early half the time and otherwise picks any allowed token: short and long values.
        def choose(ids, rng=rng):
            ends = [i for i in ids if i in structure]
            return rng.choice(ends) if ends and rng.random() < 0.5 else rng.choice(ids)

        tokens = run_decoder(decoder, choose)
        assert len(tokens) <= decoder.max_tokens
        value = json.loads(tokenizer.decode(tokens))
        validate(value)
        assert list(value) == list(EVERY_TYPE["properties"])  # every property, in the schema's order
        assert 2 <= len(value["kind"]) <= 12 and len(value["free"]) <= 20 and 1900 <= value["year"] <= 2030
        seen["grade"].add(value["grade"])
        seen["ok"].add(value["ok"])
        seen["tags"].add(len(value["tags"]))
    # The model's choices reach the answer: every enum value and both booleans came up, and lists of several lengths.
    assert seen["grade"] == {"a", "ab", "b", "unknown"} and seen["ok"] == {True, False}
    assert len(seen["tags"]) >= 2


def test_a_model_that_never_stops_is_stopped_at_the_bounds(tokenizer, table):
    """Always the longest content token, never a closing character: strings end at maxLength, arrays at maxItems."""
    decoder = ConstrainedDecoder(compile_plan(DEFAULT_ANSWER_SCHEMA, max_string_chars=200), table)
    structure = {table.char(c) for c in '"],'}
    opening = (table.char('"'), table.char(","))
    lengths = table.lengths.tolist()

    def greedy(ids):
        content = [i for i in ids if i not in structure]
        if content:
            return max(content, key=lambda i: (lengths[i], i))
        return next((i for i in ids if i in opening), ids[0])  # another item rather than the array's end

    tokens = run_decoder(decoder, greedy)
    assert len(tokens) <= decoder.max_tokens
    value = json.loads(tokenizer.decode(tokens))
    fastjsonschema.compile(DEFAULT_ANSWER_SCHEMA)(value)
    assert len(value["type"]) == 64 and len(value["notable_characteristics"]) == 5
    assert all(len(item) == 80 for item in value["notable_characteristics"])


@pytest.mark.parametrize("schema, where", [
    ({"type": "array", "items": {"type": "string"}}, "(top level)"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}, "properties.a"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "properties.a"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}, "properties.a"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}, "properties.a.items"),
    ({"type": "object", "properties": {"a": {"enum": [1, 2]}}}, "properties.a"),
])
def test_schemas_outside_the_subset_are_refused_naming_the_setting(table, schema, where):
    with pytest.raises(UnsupportedSchema, match=where.replace("(", r"\(").replace(")", r"\)")):
        compile_plan(schema)
    with pytest.raises(ValueError, match="condense.answer_schema.*condense.engine=vllm"):
        answer_decoder(CondenseSettings(), AnswerSchema(schema, "x#0", lambda v: v), table)


def test_cut_rule():
    assert cut_to_budget([10, 20, 30], 100) == [10, 20, 30]  # fits: untouched
    kept = cut_to_budget([100, 300, 600], 500)
    assert kept == [50, 150, 300] and sum(kept) <= 500  # each keeps the same share of its length
    kept = cut_to_budget([128] * 40, 1000)
    assert sum(kept) <= 1000 and len(set(kept)) == 1 and kept[0] > 0
    assert cut_to_budget([5, 7], 0) == [0, 0]


def _result(doc_id: str, texts: list[str]) -> DocumentResult:
    images = tuple({"image_index": i, "status": "ok", "source_uri": f"file:///{doc_id}/{i}.jpg", "text": t}
                   for i, t in enumerate(texts))
    return DocumentResult(doc_id=doc_id, image_count=len(texts), succeeded=len(texts), failed=0, images=images,
                          metadata={"shelf": "B4"}, completed_at=1.0)


def test_forty_images_of_128_tokens_fit_the_default_budget_and_a_smaller_one_cuts(tokenizer):
    # The tiny tokenizer is one token per byte: 128 tokens is 128 characters.
    texts = [(f"image {i}: a wooden chair, scratched legs, faded green paint " * 4)[:128] for i in range(40)]
    assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 128 for t in texts)
    schema = AnswerSchema.load(None)
    whole = Condenser(CondenseSettings(), tokenizer, schema).prompt(_result("doc-40", texts))
    assert isinstance(whole, CondensePrompt) and whole.cut is None and whole.images_used == tuple(range(40))
    assert len(whole.token_ids) <= CondenseSettings().max_prompt_tokens
    text = tokenizer.decode(whole.token_ids)
    assert all(f"[{i}] {t}" in text for i, t in enumerate(texts)) and '"shelf": "B4"' in text

    settings = CondenseSettings(max_prompt_tokens=3000)
    cut = Condenser(settings, tokenizer, schema).prompt(_result("doc-40", texts))
    assert isinstance(cut, CondensePrompt) and len(cut.token_ids) <= 3000
    assert cut.cut["rule"] == "proportional-head" and cut.cut["descriptions_cut"] == 40
    assert cut.cut["description_tokens"] == 40 * 128 and cut.cut["kept_tokens"] <= cut.cut["budget_tokens"]
    text = tokenizer.decode(cut.token_ids)
    keep = cut.cut["kept_tokens"] // 40
    assert all(f"[{i}] {t[:keep]}{CUT_MARKER}" in text for i, t in enumerate(texts))  # each keeps its head

    nothing = Condenser(settings, tokenizer, schema).prompt(DocumentResult(
        doc_id="empty", image_count=1, succeeded=0, failed=1, images=({"image_index": 0, "status": "failed"},)))
    assert isinstance(nothing, CondenseProblem) and nothing.error_kind == "nothing_to_condense"
    tight = Condenser(CondenseSettings(max_prompt_tokens=256), tokenizer, schema).prompt(_result("d", texts[:1]))
    assert isinstance(tight, CondenseProblem) and "condense.max_prompt_tokens" in tight.detail


def test_answer_check_and_settings_errors(tmp_path):
    schema = AnswerSchema.load(None)
    assert schema.check('{"type":"chair","condition":"good","notable_characteristics":["worn"]}')["type"] == "chair"
    with pytest.raises(AnswerViolation, match="condense.answer_schema"):
        schema.check('{"type":"chair","condition":"shiny","notable_characteristics":[]}')
    with pytest.raises(AnswerViolation, match="not JSON"):
        schema.check('{"type":"cha')
    with pytest.raises(ValueError, match="condense.answer_schema"):
        AnswerSchema.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="condense.prompt: .*placeholder"):
        load_prompt_template(CondenseSettings(prompt="{descriptions} {nope}"))
    with pytest.raises(ValueError, match="condense.prompt: .*{descriptions}"):
        load_prompt_template(CondenseSettings(prompt="no slot"))
    custom = tmp_path / "answer.json"
    custom.write_text(json.dumps(EVERY_TYPE))
    assert AnswerSchema.load(custom).schema_id.startswith("answer.json#")
