"""How large, deep and repetitive a constraint may be before any backend sees it (pure, no backend).

A backend's compile of a hostile constraint can recurse past Python's stack (``json.loads`` of a
schema nested 3,000 deep raises RecursionError), expand a repetition into millions of states
(``a{100000}``, ``"minItems": 100000``) or take seconds of CPU for a document of a few hundred
KiB. These checks are linear scans of the text that never recurse, so they run on the request's
own path before parsing: a constraint over a limit is a 400 naming the field and the limit
(docs/structured-outputs.md, "Limits"). The size bound itself is ``MAX_GRAMMAR_CHARS``
(``engine/request.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class ConstraintLimits:
    max_depth: int = 64  # JSON nesting (objects and arrays), regex groups, EBNF parentheses
    max_json_containers: int = 4096  # objects + arrays in one JSON schema document
    max_repeat: int = 4096  # a regex {n,m} bound; a schema's minItems/maxItems/minLength/maxLength/...
    max_rules: int = 2048  # EBNF rules (``name ::=`` lines)


LIMITS = ConstraintLimits()

# the schema keywords a backend expands into that many copies of a sub-grammar
_REPEAT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                    "minContains", "maxContains")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")
_REGEX_ESCAPE = re.compile(r"\\.", re.DOTALL)
_REGEX_CLASS = re.compile(r"\[\^?\]?(?:[^\]\\]|\\.)*\]", re.DOTALL)
_REGEX_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_EBNF_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|\[(?:[^\]\\]|\\.)*\]', re.DOTALL)
_EBNF_RULE = re.compile(r"^\s*[\w.-]+\s*::=", re.MULTILINE)


def check_constraint(kind: str, text: str, limits: ConstraintLimits = LIMITS) -> None:
    """Raise ValueError(``"<kind>: why"``) when ``text`` is over a limit; a JSON schema that is not
    JSON is refused here too (after the depth check, so ``json.loads`` cannot recurse too deep)."""
    if kind == "json_schema":
        _check_json_schema(text, limits)
    elif kind == "regex":
        _check_regex(text, limits)
    elif kind == "ebnf":
        _check_ebnf(text, limits)


def _deepest(opening: str, closing: str, marks: str) -> int:
    """The deepest nesting of ``marks`` (a string of opening and closing characters only)."""
    return max(accumulate(1 if c in opening else -1 if c in closing else 0 for c in marks), default=0)


def _check_json_schema(text: str, limits: ConstraintLimits) -> None:
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub('""', text))
    depth = _deepest("[{", "]}", brackets)
    if depth > limits.max_depth:
        raise ValueError(f"json_schema: nested {depth} deep, at most {limits.max_depth} (objects and arrays)")
    containers = sum(1 for c in brackets if c in "[{")
    if containers > limits.max_json_containers:
        raise ValueError(f"json_schema: {containers} objects and arrays, at most {limits.max_json_containers}")
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"json_schema: not a JSON document ({e})") from None
    _check_schema_repeats(schema, limits)


def _check_schema_repeats(schema: object, limits: ConstraintLimits) -> None:
    """Every repetition keyword's value within ``max_repeat`` (an explicit stack: depth is bounded
    above, but this walk need not rely on it)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in _REPEAT_KEYWORDS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.max_repeat:
                    raise ValueError(f"json_schema: {key} {value} is over the limit of {limits.max_repeat}")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_regex(text: str, limits: ConstraintLimits) -> None:
    plain = _REGEX_CLASS.sub("x", _REGEX_ESCAPE.sub("x", text))
    depth = _deepest("(", ")", "".join(c for c in plain if c in "()"))
    if depth > limits.max_depth:
        raise ValueError(f"regex: groups nested {depth} deep, at most {limits.max_depth}")
    _check_repeats("regex", plain, limits)


def _check_ebnf(text: str, limits: ConstraintLimits) -> None:
    plain = _EBNF_LITERAL.sub("x", text)
    depth = _deepest("(", ")", "".join(c for c in plain if c in "()"))
    if depth > limits.max_depth:
        raise ValueError(f"ebnf: parentheses nested {depth} deep, at most {limits.max_depth}")
    rules = len(_EBNF_RULE.findall(plain))
    if rules > limits.max_rules:
        raise ValueError(f"ebnf: {rules} rules, at most {limits.max_rules}")
    _check_repeats("ebnf", plain, limits)


def _check_repeats(kind: str, plain: str, limits: ConstraintLimits) -> None:
    """``{n}`` / ``{n,m}`` bounds (regex and EBNF write them alike) within max_repeat."""
    for m in _REGEX_REPEAT.finditer(plain):
        bound = max(int(m.group(1)), int(m.group(2) or 0))
        if bound > limits.max_repeat:
            raise ValueError(f"{kind}: repetition {m.group(0)} is over the limit of {limits.max_repeat}")
