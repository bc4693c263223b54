"""The condense stage without Kafka: a DocumentResult in, the prompt for its answer out; the model's text in, the
answer (valid against the user's answer schema) or the reason it is not out.

The prompt is the user's template (``condense.prompt`` or ``condense.prompt_file``) filled with the document's id,
image count, metadata, answer schema and its described images, one line each (``[index] text``), inside the
model's chat template. It must fit ``condense.max_prompt_tokens``. When the descriptions do not, they are cut by one
stated rule (``cut_to_budget``): every description keeps its head, all cut in the same proportion, so that together
they fill the budget left after the template; the summary's ``cut`` field records the budget, the tokens the
descriptions had and kept, and how many were cut. A document of 40 images with 128-token descriptions (~5,500 tokens
with their line prefixes) fits the default budget of 6,144 uncut.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from schemas import DocumentResult
from vlmstream.config import CondenseSettings

# The story's example: what a downstream classifier wants from each document.
DEFAULT_ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "minLength": 1, "maxLength": 64,
                 "description": "What the document shows (e.g. chair, invoice, painting)."},
        "condition": {"enum": ["new", "good", "fair", "poor", "damaged", "unknown"]},
        "notable_characteristics": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 80},
                                    "maxItems": 5},
    },
    "required": ["type", "condition", "notable_characteristics"],
    "additionalProperties": False,
}
CUT_RULE = "proportional-head"
CUT_MARKER = " [...]"
MAX_METADATA_CHARS = 2000
TEMPLATE_FIELDS = ("doc_id", "image_count", "metadata", "descriptions", "schema")


class AnswerViolation(ValueError):
    """The model's text is not JSON or does not satisfy the answer schema: the document's dead letter."""

    error_kind = "answer_schema_violation"


@dataclass(frozen=True)
class AnswerSchema:
    schema: dict[str, Any]
    schema_id: str  # the file's name (or "default") and a hash of the schema, carried by every summary
    _validate: Callable[[Any], Any]

    @classmethod
    def load(cls, path: str | Path | None) -> "AnswerSchema":
        import fastjsonschema

        if path:
            try:
                schema = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"condense.answer_schema {path!s} is not a readable JSON Schema file: {exc}") from exc
            name = Path(path).name
        else:
            schema, name = DEFAULT_ANSWER_SCHEMA, "default"
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ValueError(f'condense.answer_schema {name}: the answer must be a JSON object ({{"type": "object", '
                             f'...}}), the summary\'s `answer` field')
        try:
            validate = fastjsonschema.compile(schema)
        except fastjsonschema.JsonSchemaDefinitionException as exc:
            raise ValueError(f"condense.answer_schema {name}: not a valid JSON Schema: {exc}") from exc
        digest = hashlib.blake2b(json.dumps(schema, sort_keys=True).encode(), digest_size=6).hexdigest()
        return cls(schema, f"{name}#{digest}", validate)

    def check(self, text: str) -> dict[str, Any]:
        import fastjsonschema

        try:
            value = json.loads(text)
        except ValueError as exc:
            raise AnswerViolation(f"the answer is not JSON ({exc}): {text[:300]!r}") from None
        try:
            self._validate(value)
        except fastjsonschema.JsonSchemaException as exc:
            raise AnswerViolation(f"the answer does not satisfy condense.answer_schema ({self.schema_id}): "
                                  f"{exc.message}; answer: {text[:300]!r}") from None
        return value


def load_prompt_template(settings: CondenseSettings) -> str:
    """The template, checked at start: a placeholder it cannot fill is named with the setting that holds it."""
    setting = "condense.prompt_file" if settings.prompt_file else "condense.prompt"
    if settings.prompt_file:
        try:
            template = Path(settings.prompt_file).read_text()
        except OSError as exc:
            raise ValueError(f"condense.prompt_file {settings.prompt_file}: cannot be read: {exc}") from exc
    else:
        template = settings.prompt
    try:
        template.format(**{name: "" for name in TEMPLATE_FIELDS})
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{setting}: the template has a placeholder other than {{{'}, {'.join(TEMPLATE_FIELDS)}}}"
                         f" or a stray brace ({exc!r}); write a literal brace as {{{{ or }}}}") from None
    if "{descriptions}" not in template:
        raise ValueError(f"{setting}: the template must contain {{descriptions}}, where the image descriptions go")
    return template


def cut_to_budget(lengths: list[int], budget: int) -> list[int]:
    """Tokens each description keeps: all of them when they fit ``budget``; otherwise each keeps its head, all cut
    in the same proportion (``length * budget // total``), so the kept tokens add up to at most ``budget``."""
    total = sum(lengths)
    if total <= budget:
        return list(lengths)
    budget = max(0, budget)
    return [length * budget // total for length in lengths]


def result_fingerprint(result: DocumentResult) -> str:
    """What a result says (its images' outcomes, source URIs, texts, and its metadata), hashed: two results that
    say the same have the same fingerprint."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([result.image_count, [[i.get("image_index"), i.get("status"), i.get("source_uri"),
                                                     i.get("text")] for i in result.images]],
                             sort_keys=True).encode())
    digest.update(json.dumps(result.metadata, sort_keys=True, default=str).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class CondensePrompt:
    token_ids: list[int]
    images_used: tuple[int, ...]
    cut: dict[str, Any] | None


@dataclass(frozen=True)
class CondenseProblem:
    """A document that cannot be condensed: its dead letter (not retriable: the same result fails again)."""

    error_kind: str
    detail: str


class Condenser:
    """Builds a document's prompt (with the engine's tokenizer) and checks the model's answer."""

    def __init__(self, settings: CondenseSettings, tokenizer: Any, answer_schema: AnswerSchema,
                 template: str | None = None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.answer_schema = answer_schema
        self.template = template if template is not None else load_prompt_template(settings)
        self._schema_text = json.dumps(answer_schema.schema, ensure_ascii=False, separators=(",", ":"))

    def chat(self, instruction: str) -> list[int]:
        """The instruction as one user turn in the model's chat template, as token ids."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                                      add_generation_prompt=True)
        else:
            text = instruction + "\n"
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _fill(self, result: DocumentResult, lines: list[str]) -> list[int]:
        metadata = json.dumps(result.metadata, ensure_ascii=False, sort_keys=True, default=str)
        if len(metadata) > MAX_METADATA_CHARS:
            metadata = metadata[:MAX_METADATA_CHARS] + CUT_MARKER
        return self.chat(self.template.format(doc_id=result.doc_id, image_count=result.image_count,
                                              metadata=metadata, descriptions="\n".join(lines),
                                              schema=self._schema_text))

    def prompt(self, result: DocumentResult) -> CondensePrompt | CondenseProblem:
        described = [(i["image_index"], i["text"]) for i in sorted(result.images, key=lambda i: i["image_index"])
                     if i.get("status") == "ok" and (i.get("text") or "").strip()]
        if not described:
            return CondenseProblem("nothing_to_condense", f"none of the document's {result.image_count} image(s) has "
                                   f"a description ({result.failed} failed)")
        limit = self.settings.max_prompt_tokens
        prefixes = [f"[{index}] " for index, _ in described]
        bare = self._fill(result, prefixes)  # the template and the line prefixes, without any description text
        if len(bare) >= limit:
            return CondenseProblem("prompt_too_long", f"the prompt without any description text is {len(bare)} "
                                   f"tokens, over condense.max_prompt_tokens ({limit}): shorten condense.prompt or "
                                   f"raise the budget")
        texts = [self.tokenizer.encode(text, add_special_tokens=False) for _, text in described]
        lengths = [len(t) for t in texts]
        budget = limit - len(bare)
        for _ in range(4):  # tokens at the joins can merge or split differently: shrink by what is over and redo
            kept = cut_to_budget(lengths, budget)
            lines = [prefix + (self.tokenizer.decode(ids) if k == len(ids) else
                               self.tokenizer.decode(ids[:k]) + CUT_MARKER)
                     for prefix, ids, k in zip(prefixes, texts, kept)]
            token_ids = self._fill(result, lines)
            if len(token_ids) <= limit:
                break
            budget -= len(token_ids) - limit + len(lines) * len(CUT_MARKER)
        else:
            return CondenseProblem("prompt_too_long", f"the descriptions could not be cut to fit "
                                   f"condense.max_prompt_tokens ({limit})")
        cut = None
        if kept != lengths:
            cut = {"budget_tokens": max(0, budget), "description_tokens": sum(lengths), "kept_tokens": sum(kept),
                   "descriptions_cut": sum(1 for k, n in zip(kept, lengths) if k < n), "rule": CUT_RULE}
        return CondensePrompt(token_ids, tuple(index for index, _ in described), cut)

    def answer(self, text: str) -> dict[str, Any]:
        """The answer, or ``AnswerViolation``."""
        return self.answer_schema.check(text)
