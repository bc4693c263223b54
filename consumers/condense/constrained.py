"""A JSON Schema constrained decoder for engines without guided decoding of their own (transformers).

The answer is generated token by token; at each step the decoder says which tokens the model may choose. Structure
(braces, property names, quotes, commas) is forced; content (string text, digits, enum and boolean choices, the end of
a string, a number or an array) is the model's choice among the tokens that keep the answer valid, so every answer
parses and every length is bounded.

The subset supported (``compile_plan`` refuses anything else, naming the path in the schema):

* the top level is ``{"type": "object", "properties": {...}}``; every property is written, in the schema's order
  (so ``required`` may list any of them); ``additionalProperties`` is allowed (none are ever written);
* a property is one of: ``{"type": "string"}`` with optional ``minLength``/``maxLength`` (unset: the
  ``condense.max_string_chars`` bound); a string ``enum`` (with or without ``"type": "string"``);
  ``{"type": "boolean"}``; ``{"type": "integer"}``, unbounded, or with ``minimum`` >= 0 and optional ``maximum``;
  ``{"type": "number"}`` without bounds; ``{"type": "array", "items": <string or string enum>}`` with optional
  ``minItems``/``maxItems`` (unset: ``condense.max_array_items``);
* ``title``, ``description``, ``default`` and ``examples`` are ignored anywhere.

Numbers are bounded to 9 integer digits and 6 decimals. Strings exclude tokens that contain a quote, a backslash, a
control character or an incomplete UTF-8 sequence, so nothing in them needs escaping.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Generator, Iterable

IGNORED_KEYWORDS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment"})
MAX_INT_DIGITS = 9
MAX_FRACTION_DIGITS = 6


class UnsupportedSchema(ValueError):
    """A schema outside the subset the constrained decoder enforces."""


@dataclass(frozen=True)
class StringNode:
    min_length: int
    max_length: int


@dataclass(frozen=True)
class EnumNode:
    values: tuple[Any, ...]  # strings, or (True, False) for a boolean


@dataclass(frozen=True)
class NumberNode:
    integer: bool
    minimum: int | None = None  # integers only, >= 0
    maximum: int | None = None


@dataclass(frozen=True)
class ArrayNode:
    item: StringNode | EnumNode
    min_items: int
    max_items: int


Node = StringNode | EnumNode | NumberNode | ArrayNode


@dataclass(frozen=True)
class ObjectPlan:
    properties: tuple[tuple[str, Node], ...]


def _check_keywords(spec: dict, allowed: set[str], path: str) -> None:
    extra = set(spec) - allowed - IGNORED_KEYWORDS
    if extra:
        raise UnsupportedSchema(f"{path}: keyword(s) {sorted(extra)} are not supported by the constrained decoder")


def _bound(spec: dict, key: str, default: int, path: str) -> int:
    value = spec.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UnsupportedSchema(f"{path}: {key} must be a whole number >= 0, got {value!r}")
    return value


def _string_or_enum(spec: dict, path: str, max_string_chars: int) -> StringNode | EnumNode:
    if "enum" in spec:
        _check_keywords(spec, {"enum", "type"}, path)
        values = spec["enum"]
        if spec.get("type", "string") != "string" or not values or not all(isinstance(v, str) for v in values):
            raise UnsupportedSchema(f"{path}: only an enum of strings is supported")
        return EnumNode(tuple(dict.fromkeys(values)))
    if spec.get("type") != "string":
        raise UnsupportedSchema(f"{path}: expected a string or a string enum, got {json.dumps(spec)[:120]}")
    _check_keywords(spec, {"type", "minLength", "maxLength"}, path)
    low = _bound(spec, "minLength", 0, path)
    high = _bound(spec, "maxLength", max(low, max_string_chars), path)
    if high < low:
        raise UnsupportedSchema(f"{path}: maxLength {high} is below minLength {low}")
    return StringNode(low, high)


def _node(spec: Any, path: str, max_string_chars: int, max_array_items: int) -> Node:
    if not isinstance(spec, dict):
        raise UnsupportedSchema(f"{path}: a property's schema must be an object")
    kind = spec.get("type")
    if "enum" in spec or kind == "string":
        return _string_or_enum(spec, path, max_string_chars)
    if kind == "boolean":
        _check_keywords(spec, {"type"}, path)
        return EnumNode((True, False))
    if kind == "integer":
        _check_keywords(spec, {"type", "minimum", "maximum"}, path)
        low, high = spec.get("minimum"), spec.get("maximum")
        if high is not None and low is None:
            raise UnsupportedSchema(f"{path}: an integer with a maximum needs a minimum >= 0 too")
        if low is not None:
            low = _bound(spec, "minimum", 0, path)
            if high is not None and (not isinstance(high, int) or high < low or len(str(high)) > MAX_INT_DIGITS):
                raise UnsupportedSchema(f"{path}: maximum must be a whole number from minimum to 999999999")
        return NumberNode(True, low, high)
    if kind == "number":
        _check_keywords(spec, {"type"}, path)
        return NumberNode(False)
    if kind == "array":
        _check_keywords(spec, {"type", "items", "minItems", "maxItems"}, path)
        item = _string_or_enum(spec.get("items") or {}, f"{path}.items", max_string_chars)
        low = _bound(spec, "minItems", 0, path)
        high = _bound(spec, "maxItems", max(low, max_array_items), path)
        if high < low:
            raise UnsupportedSchema(f"{path}: maxItems {high} is below minItems {low}")
        return ArrayNode(item, low, high)
    raise UnsupportedSchema(f"{path}: type {kind!r} is not supported (string, enum, boolean, integer, number, "
                            f"array of strings)")


def compile_plan(schema: dict, *, max_string_chars: int = 200, max_array_items: int = 8) -> ObjectPlan:
    """The decoding plan of a schema in the supported subset; raises ``UnsupportedSchema`` otherwise."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise UnsupportedSchema('(top level): must be {"type": "object", "properties": {...}}')
    _check_keywords(schema, {"type", "properties", "required", "additionalProperties"}, "(top level)")
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        raise UnsupportedSchema("(top level): needs at least one property")
    unknown = set(schema.get("required") or ()) - set(properties)
    if unknown:
        raise UnsupportedSchema(f"(top level): required names properties it does not define: {sorted(unknown)}")
    return ObjectPlan(tuple((name, _node(spec, f"properties.{name}", max_string_chars, max_array_items))
                            for name, spec in properties.items()))


# --- the vocabulary ---------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f\"\\\ufffd]")
_DIGITS = re.compile(r"[0-9]+")


class TokenTable:
    """What each token of a tokenizer is as text, for the decoder: which tokens may stand inside a JSON string
    (``string_ok``) and how many characters each adds, which are digits, and the ids of the single characters the
    structure needs. ``vocab_size``: the model's logits width (it may exceed the tokenizer's)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None):
        import torch

        self.tokenizer = tokenizer
        count = len(tokenizer)
        self.vocab_size = max(vocab_size or count, count)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        texts = tokenizer.batch_decode([[i] for i in range(count)])
        self.string_ok = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.lengths = torch.full((self.vocab_size,), 1 << 30, dtype=torch.long)
        self.digits: list[tuple[int, str]] = []
        ok, lengths = [], []
        for i, text in enumerate(texts):
            if i in special or not text:
                continue
            if not _CONTROL.search(text):
                ok.append(i)
                lengths.append(len(text))
            if _DIGITS.fullmatch(text):
                self.digits.append((i, text))
        self.string_ok[ok] = True
        self.lengths[ok] = torch.tensor(lengths, dtype=torch.long)
        self._encoded: dict[str, tuple[int, ...]] = {}
        self.texts = texts

    def encode(self, text: str) -> tuple[int, ...]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return ids

    def char(self, c: str) -> int:
        ids = self.encode(c)
        if len(ids) != 1:
            raise UnsupportedSchema(f"the tokenizer has no single token for {c!r}; the constrained decoder needs one")
        return ids[0]

    def mask(self, ids: Iterable[int]):
        import torch

        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[list(ids)] = True
        return out


# --- decoding ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Forced:
    token: int


@dataclass(frozen=True)
class Allowed:
    mask: Any  # torch bool tensor over the vocabulary


Step = Forced | Allowed
Decoder = Generator[Step, int, None]


class ConstrainedDecoder:
    """Per answer: ``steps()`` is a generator that yields what the next token may be (``Forced`` or ``Allowed``) and
    is sent the token chosen; it ends when the answer is complete. ``max_tokens`` bounds its length."""

    def __init__(self, plan: ObjectPlan, table: TokenTable):
        self.plan = plan
        self.table = table
        self.quote, self.comma = table.char('"'), table.char(",")
        self.close_object, self.close_array = table.char("}"), table.char("]")
        self.minus, self.point = table.char("-"), table.char(".")
        self.max_tokens = self._bound()

    def _separator(self, index: int) -> str:
        name = json.dumps(self.plan.properties[index][0], ensure_ascii=False)
        return ("{" if index == 0 else ",") + name + ":"

    def _bound(self) -> int:
        """Most tokens an answer can take (each content token adds at least one character)."""
        total = 1
        for index, (_, node) in enumerate(self.plan.properties):
            total += len(self.table.encode(self._separator(index)))
            total += self._node_bound(node)
        return total

    def _node_bound(self, node: Node) -> int:
        if isinstance(node, StringNode):
            return node.max_length + 2
        if isinstance(node, EnumNode):
            return max(len(self.table.encode(json.dumps(v))) for v in node.values) + 1
        if isinstance(node, NumberNode):
            return MAX_INT_DIGITS + MAX_FRACTION_DIGITS + 3
        return 2 + node.max_items * (self._node_bound(node.item) + 2)

    def steps(self) -> Decoder:
        properties = self.plan.properties
        pending_close = False  # a number ends when the model chooses the next structure character: it is consumed
        for index, (_, node) in enumerate(properties):
            separator = self._separator(index)
            yield from self._force(separator[1:] if pending_close else separator)
            follow = self.close_object if index == len(properties) - 1 else self.comma
            pending_close = yield from self._value(node, follow)
        if not pending_close:
            yield Forced(self.close_object)

    def _force(self, text: str) -> Decoder:
        for token in self.table.encode(text):
            yield Forced(token)

    def _value(self, node: Node, follow: int):
        if isinstance(node, StringNode):
            yield Forced(self.quote)
            yield from self._string_body(node)
            return False
        if isinstance(node, EnumNode):
            yield from self._choose([json.dumps(v) for v in node.values])
            return False
        if isinstance(node, NumberNode):
            return (yield from self._number(node, follow))
        yield from self._array(node)
        return False

    def _string_body(self, node: StringNode) -> Decoder:
        """After the opening quote: text tokens up to max_length characters, then the closing quote."""
        table, used = self.table, 0
        while True:
            remaining = node.max_length - used
            if remaining <= 0:
                yield Forced(self.quote)
                return
            mask = table.string_ok & (table.lengths <= remaining)
            if used >= node.min_length:
                mask[self.quote] = True
            if not bool(mask.any()):
                yield Forced(self.quote)
                return
            token = yield Allowed(mask)
            if token == self.quote:
                return
            used += len(table.texts[token])

    def _choose(self, options: list[str]) -> Decoder:
        """One of ``options`` (JSON texts), token by token: their token sequences are prefix-free."""
        sequences = [self.table.encode(text) for text in options]
        chosen: list[int] = []
        while tuple(chosen) not in sequences:
            following = {s[len(chosen)] for s in sequences if len(s) > len(chosen) and list(s[:len(chosen)]) == chosen}
            if len(following) == 1:
                token = yield Forced(next(iter(following)))
            else:
                token = yield Allowed(self.table.mask(following))
            chosen.append(token)

    def _array(self, node: ArrayNode) -> Decoder:
        yield Forced(self.table.char("["))
        count = 0
        while True:
            options = ([self.quote] if count < node.max_items else []) + (
                [self.close_array] if count >= node.min_items else [])
            if count:
                options = [self.comma if o == self.quote else o for o in options]
            token = yield (Forced(options[0]) if len(options) == 1 else Allowed(self.table.mask(options)))
            if token == self.close_array:
                return
            if token == self.comma:
                yield Forced(self.quote)
            if isinstance(node.item, StringNode):
                yield from self._string_body(node.item)
            else:
                # The opening quote is written: the options go on from their second character.
                yield from self._choose([json.dumps(v)[1:] for v in node.item.values])
            count += 1

    def _number(self, node: NumberNode, follow: int):
        """Digits (a sign, a decimal point) the model chooses; it ends the number by choosing ``follow``, the next
        structure character, which is then consumed. Returns True (follow consumed)."""
        text = ""
        while True:
            candidates = [(token, digits) for token, digits in self.table.digits if _number_viable(text + digits, node)]
            if text == "" and node.minimum is None:
                candidates.append((self.minus, "-"))
            if not node.integer and "." not in text and _number_complete(text, node):
                candidates.append((self.point, "."))
            ids = [token for token, _ in candidates]
            if _number_complete(text, node):
                ids.append(follow)
            if not ids:  # cannot happen for a viable prefix; end here and let validation speak
                yield Forced(follow)
                return True
            token = yield (Forced(ids[0]) if len(ids) == 1 else Allowed(self.table.mask(ids)))
            if token == follow:
                return True
            text += dict(candidates)[token]


_INT = re.compile(r"-?(0|[1-9][0-9]{0,%d})" % (MAX_INT_DIGITS - 1))
_NUMBER = re.compile(r"-?(0|[1-9][0-9]{0,%d})(\.[0-9]{1,%d})?" % (MAX_INT_DIGITS - 1, MAX_FRACTION_DIGITS))
_NUMBER_PREFIX = re.compile(r"-?|-?(0|[1-9][0-9]{0,%d})(\.[0-9]{0,%d})?" % (MAX_INT_DIGITS - 1, MAX_FRACTION_DIGITS))


def _number_complete(text: str, node: NumberNode) -> bool:
    if not (_INT if node.integer else _NUMBER).fullmatch(text):
        return False
    if node.minimum is None:
        return True
    value = int(text)
    return value >= node.minimum and (node.maximum is None or value <= node.maximum)


def _number_viable(text: str, node: NumberNode) -> bool:
    """Whether ``text`` can still grow into a number the node accepts."""
    if not _NUMBER_PREFIX.fullmatch(text) or (node.integer and "." in text):
        return False
    if node.minimum is None or text in ("", "-"):
        return node.minimum is None or text == ""
    if text.startswith("-"):
        return False
    value = int(text)
    if text.startswith("0"):
        return _number_complete(text, node)  # a leading zero is the whole number
    high = node.maximum if node.maximum is not None else 10 ** MAX_INT_DIGITS - 1
    for extra in range(MAX_INT_DIGITS - len(text) + 1):
        low_end, high_end = value * 10 ** extra, value * 10 ** extra + 10 ** extra - 1
        if low_end <= high and high_end >= node.minimum:
            return True
    return False
