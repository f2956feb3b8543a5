"""Where the members of a JSON object, possibly cut short, lie in a text.

Tool-call formats that wrap the arguments in a JSON object (``{"name": ..., "arguments": {...}}``)
need the arguments' raw text while the object is still arriving: this finds each member's value
span without parsing the values (a string is skipped by one regex match, nested brackets are
counted), so it is cheap to rerun on every token. It validates only the object's own shape
(keys, colons, commas); the values are whatever the model wrote between their bounds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set
from dataclasses import dataclass, field

from pdserve.parsers.base import ToolCall

_WS = re.compile(r"[ \t\r\n]*")
# A string, its body unrolled (runs of plain characters between escapes) so one match is one
# C-level pass; group 1 is None while the string is not closed.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?', re.S)
_SCALAR = re.compile(r'[^\s,\]}"\[{:]*')
_NESTED = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?|[\[{\]}]', re.S)


@dataclass
class Member:
    start: int  # offset of the value's first character
    end: int | None  # just past the value; None: the value is not complete yet


@dataclass
class ObjectScan:
    members: dict[str, Member] = field(default_factory=dict)  # first occurrence of each key, in order
    end: int | None = None  # just past the closing brace; None: not closed (yet)
    error_at: int | None = None  # where the object's shape broke; members found before it stand


def skip_ws(text: str, i: int, stop: int) -> int:
    return _WS.match(text, i, stop).end()  # type: ignore[union-attr]  # matches the empty string


def value_end(text: str, i: int, stop: int) -> tuple[int | None, bool]:
    """(end of the JSON value starting at ``text[i]``, or None if ``stop`` comes first; error)."""
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i, stop)
        return (m.end(), False) if m and m.group(1) else (None, False)
    if c in "{[":
        depth = 0
        for m in _NESTED.finditer(text, i, stop):
            token = m.group()
            if token[0] == '"':
                if m.group(1) is None:
                    return None, False
            else:
                depth += 1 if token in "{[" else -1
                if depth == 0:
                    return m.end(), False
        return None, False
    m = _SCALAR.match(text, i, stop)
    end = m.end() if m else i
    if end == i:
        return None, True
    return (None, False) if end == stop else (end, False)


def scan_object(text: str, start: int, stop: int) -> ObjectScan:
    """The members of the object opening at ``text[start] == "{"``, looking no further than ``stop``."""
    out = ObjectScan()
    p = skip_ws(text, start + 1, stop)
    if p < stop and text[p] == "}":
        out.end = p + 1
        return out
    while p < stop:
        key_end = _key_end(text, p, stop, out)
        if key_end is None:
            return out
        key = _decode(text[p:key_end])
        p = skip_ws(text, key_end, stop)
        if p >= stop:
            return out
        if text[p] != ":" or not isinstance(key, str):
            out.error_at = p
            return out
        p = skip_ws(text, p + 1, stop)
        if p >= stop:
            return out
        end, bad = value_end(text, p, stop)
        if bad:
            out.error_at = p
            return out
        out.members.setdefault(key, Member(p, end))
        if end is None:
            return out
        p = skip_ws(text, end, stop)
        if p >= stop:
            return out
        if text[p] == "}":
            out.end = p + 1
            return out
        if text[p] != ",":
            out.error_at = p
            return out
        p = skip_ws(text, p + 1, stop)
    return out


def _key_end(text: str, p: int, stop: int, out: ObjectScan) -> int | None:
    if text[p] != '"':
        out.error_at = p
        return None
    m = _STRING.match(text, p, stop)
    return m.end() if m and m.group(1) else None


def _decode(token: str):
    try:
        return json.loads(token)
    except ValueError:
        return None


def string_value(text: str, member: Member | None) -> str | None:
    """The decoded value of a complete JSON-string member, else None."""
    if member is None or member.end is None or text[member.start] != '"':
        return None
    value = _decode(text[member.start:member.end])
    return value if isinstance(value, str) else None


def arguments_text(text: str, stop: int, scan: ObjectScan, keys: tuple[str, ...], complete: bool) -> str:
    """The raw arguments of a call object scanned up to ``stop``: the value of the first of ``keys``
    to appear, as far as it goes (trailing whitespace held back). No such member: "" while the object may still grow,
    "{}" once it cannot. A string value (arguments encoded twice, as some models write them) is
    decoded, and only once complete: its raw prefix is no prefix of the decoded text."""
    member = next((m for k, m in scan.members.items() if k in keys), None)
    if member is None:
        return "{}" if complete or scan.end is not None or scan.error_at is not None else ""
    if text[member.start] == '"':
        return string_value(text, member) or ""
    end = member.end if member.end is not None else stop
    return text[member.start:end].rstrip()


def object_call(text: str, stop: int, scan: ObjectScan, tools: Set[str], keys: tuple[str, ...],
                complete: bool) -> ToolCall | None:
    """The call a ``{"name": ..., KEY: {...}}`` object makes, once its name is known and is one of
    ``tools``; None until then, or for good if it is not."""
    name = string_value(text, scan.members.get("name"))
    if name is None or name not in tools:
        return None
    return ToolCall(name, arguments_text(text, stop, scan, keys, complete))
