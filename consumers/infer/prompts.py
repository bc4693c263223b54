"""Prompts and structured output, shared by every engine.

The prompt is the model's own chat template around one image and the configured instruction. An optional
JSON Schema constrains the output: vLLM enforces it while decoding (structured outputs); every engine
then validates the final text against it, so a description that does not satisfy the schema becomes an
``output_schema_violation`` failure instead of a published result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from vlmstream.models.family import ModelFamily
from vlmstream.models.qwen2_vl import QWEN2_VL


class PromptBuilder:
    """Renders the chat prompt for one image. Uses the tokenizer's chat template when it has one (once per
    distinct instruction, cached), so a real checkpoint's template wins over the family's built-in one."""

    def __init__(self, tokenizer: Any | None = None, family: ModelFamily = QWEN2_VL):
        self._tokenizer = tokenizer
        self._family = family
        self._render = lru_cache(maxsize=64)(self._render_uncached)

    def prompt(self, instruction: str) -> str:
        """The prompt with the single image placeholder (vLLM expands it to the image's tokens)."""
        return self._render(instruction)

    def expanded(self, instruction: str, visual_tokens: int) -> str:
        """The prompt with the placeholder already expanded to ``visual_tokens`` pad tokens (transformers)."""
        pad = self._family.image_pad
        return self._render(instruction).replace(pad, pad * visual_tokens, 1)

    def _render_uncached(self, instruction: str) -> str:
        template = getattr(self._tokenizer, "chat_template", None)
        if template:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
            text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # A family module knows its pad token and checks it; on the generic path the template's own image
            # marker (Gemma 3's <start_of_image>, ...) is what the model's processor expands.
            if text.count(self._family.image_pad) == 1 or not self._family.exact_size:
                return text
        if not self._family.exact_size:
            raise ValueError("the generic path needs the checkpoint's chat template to place the image in the prompt, "
                             "and this tokenizer has none: use a checkpoint folder with chat_template.json or a "
                             "chat_template in tokenizer_config.json (infer.model)")
        return self._family.prompt(instruction)


PAGE_TEXT = "{page_text}"


def instruction_for(template: str, metadata: dict[str, Any] | None) -> str:
    """infer.prompt for one image: ``{page_text}`` becomes the image's page text (a PDF page's text layer, which
    decode carries as metadata ``page_text`` up to decode.pdf_page_text_chars), '' where it has none. Only that
    placeholder: a prompt's other braces (a JSON example) are the user's text."""
    if PAGE_TEXT not in template:
        return template
    text = (metadata or {}).get("page_text")
    return template.replace(PAGE_TEXT, text if isinstance(text, str) else "")


class OutputSchemaViolation(ValueError):
    """The generated text is not JSON or does not satisfy the configured schema. Not retriable: the same
    input with greedy decoding produces the same text."""

    error_kind = "output_schema_violation"
    retriable = False


_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


@dataclass(frozen=True)
class OutputSchema:
    """A JSON Schema the output must satisfy; ``check(text)`` returns the parsed value or raises."""

    schema: dict
    _validate: Callable[[Any], Any]

    @classmethod
    def from_dict(cls, schema: dict) -> "OutputSchema":
        # fastjsonschema compiles the schema to Python once; validating a short description is ~microseconds.
        import fastjsonschema

        return cls(schema, fastjsonschema.compile(schema))

    @classmethod
    def load(cls, path: str | Path | None) -> "OutputSchema | None":
        if not path:
            return None
        try:
            schema = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"infer.output_schema {path!s} is not a readable JSON Schema file: {exc}") from exc
        return cls.from_dict(schema)

    def check(self, text: str) -> Any:
        import fastjsonschema

        # Models without guided decoding often wrap JSON in a Markdown fence; the fence is not the answer.
        fenced = _FENCE.match(text)
        body = fenced.group(1) if fenced else text
        try:
            value = json.loads(body)
        except ValueError as exc:
            raise OutputSchemaViolation(f"output is not JSON ({exc}): {text[:200]!r}") from None
        try:
            self._validate(value)
        except fastjsonschema.JsonSchemaException as exc:
            raise OutputSchemaViolation(f"output does not satisfy the schema: {exc.message}") from None
        return value


def with_schema(schema: OutputSchema | None, output):
    """An engine's finished output, checked against the schema: the output with ``parsed_json`` set, or an
    ``InferenceFailure`` naming the violation."""
    from dataclasses import replace

    from consumers.infer.engine import InferenceFailure

    if schema is None:
        return output
    try:
        return replace(output, parsed_json=schema.check(output.text))
    except OutputSchemaViolation as exc:
        return InferenceFailure(output.request_id, exc.error_kind, str(exc), retriable=exc.retriable)
