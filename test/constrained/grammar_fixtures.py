"""What the constrained tests share: the bundled tokenizer, the model's logits width (which pads
past the tokenizer's vocabulary), schemas whose valid outputs a random-weight model would
almost never write by itself, and checks of an output against its constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema

from pdserve.constrained import BACKENDS

PRESET_DIR = Path(__file__).resolve().parents[2] / "python" / "pdserve" / "assets" / "presets" / "tiny-llama"
VOCAB = 2048  # tiny-llama's lm_head; its tokenizer has 2000 tokens
EOS = 1

# Bounded so a random walk ends.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "level": {"enum": [1, 2, 3]},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "level", "tags", "ok"], "additionalProperties": False}
REGEX = r"(cat|dog)-[0-9]{2,4}(\.[a-f]{1,3})?"
# GBNF (xgrammar's EBNF dialect, which llguidance converts to Lark)
EBNF = 'root ::= "(" expr ")"\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "x"'
EBNF_RE = r"\([0-9x](\+[0-9x])*\)"
INSTALLED = sorted(BACKENDS)
# outlines-core does not enforce minimum / maximum: its outputs are checked without them
UNBOUNDED = {**PERSON, "properties": {**PERSON["properties"], "age": {"type": "integer"}}}


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PRESET_DIR))


def check_output(kind: str, text: str, backend: str = "xgrammar") -> None:
    """Raise unless ``text`` satisfies the constraint of ``kind`` (PERSON, REGEX or EBNF)."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), UNBOUNDED if backend == "outlines" else PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(EBNF_RE, text), text


CONSTRAINTS = {"json_schema": json.dumps(PERSON), "regex": REGEX, "ebnf": EBNF}


THINK_END = "</think>"


def end_thinking_at(scheduler, k: int) -> None:
    """Make ``scheduler``'s model end its thinking part on purpose (a random model never does):
    a request with ``sampling.think_end`` THINK_END writes that marker's tokens as its output tokens k, k+1, ...
    (its logits there are raised before any grammar mask, as a model's own would be)."""
    marker = scheduler.tokenizer.encode(THINK_END, add_special_tokens=False)
    sample = scheduler._sample_and_append

    def biased(reqs, logits, mask=None):
        logits = logits.clone()  # the forward's own is an inference tensor
        for i, r in enumerate(reqs):
            n = len(r.output_ids) - k
            if r.sampling.think_end == THINK_END and 0 <= n < len(marker):
                logits[i, marker[n]] = logits[i].max() + 100
        return sample(reqs, logits, mask)

    scheduler._sample_and_append = biased


# JSON schemas for the strict-parser fuzz (test/engine/test_json_fuzz.py) and the token-table
# property test (test/constrained/test_json_strings.py): every string, array and number is bounded,
# so a random-weight model's sample ends within FUZZ_MAX_TOKENS tokens however it spells the text
# (a byte-level tokenizer may spend one token per byte, four per character).
FUZZ_SCHEMAS = {
    # the schema: a maxLength string let raw control characters through (xgrammar)
    "issue": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 6}},
        "required": ["color", "ok", "tag"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 4},
            "id": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["name", "id"], "additionalProperties": False},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "note": {"type": "string", "maxLength": 3}},
        "required": ["user"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 5},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99},
                "minItems": 1, "maxItems": 3},
        "level": {"enum": [1, 2.5, "x", None]}},
        "required": ["n", "ids", "level"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
        "alias": {"type": "string", "minLength": 2, "maxLength": 3},
        "mode": {"const": "on"}},
        "required": ["code", "alias"], "additionalProperties": False},
    "keys": {"type": "array", "maxItems": 2, "items": {
        "type": "string", "minLength": 1, "maxLength": 2}},
}
FUZZ_MAX_TOKENS = 96


def without_bounds(schema):
    """``schema`` without minimum / maximum: outlines-core does not enforce them on integers
    (docs/structured-outputs.md), so its outputs are checked against the rest."""
    if isinstance(schema, dict):
        return {k: without_bounds(v) for k, v in schema.items() if k not in ("minimum", "maximum")}
    if isinstance(schema, list):
        return [without_bounds(v) for v in schema]
    return schema


def check_json(text: str, name: str, backend: str = "xgrammar") -> None:
    """Raise unless ``text`` is one strict JSON document valid under FUZZ_SCHEMAS[name]."""
    schema = without_bounds(FUZZ_SCHEMAS[name]) if backend == "outlines" else FUZZ_SCHEMAS[name]
    jsonschema.validate(json.loads(text), schema)
