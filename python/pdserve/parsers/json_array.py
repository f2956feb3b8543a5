"""The form ``tool_choice`` "required" and a named function force, whatever the model family:
a JSON array of ``{"name": ..., "parameters": {...}}`` objects, produced under a JSON-schema
grammar built from the request's tools (SGLang builds the same array when no model-native
structure is used). ``schema`` builds the grammar's schema; ``JsonArrayToolParser`` reads the
array back into calls, incrementally like every parser here.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.parsers.base import ContentBuilder, Scan, ToolParser
from pdserve.parsers.json_scan import object_call, scan_object, skip_ws

ARGUMENT_KEYS = ("parameters", "arguments")
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters


def schema(functions: Sequence[tuple[str, dict | None]], parallel: bool) -> dict:
    """The JSON schema of a non-empty array of calls of ``functions`` ((name, parameters schema)
    pairs; one pair for a named choice); one call at most unless ``parallel``."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": params if params is not None else EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in functions]
    out: dict = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        out["maxItems"] = 1
    return out


class JsonArrayToolParser(ToolParser):
    name = "json_array"

    def scan(self, text: str, final: bool) -> Scan:
        out = ContentBuilder()
        p = skip_ws(text, 0, len(text))
        if p == len(text) or text[p] != "[":
            out.text(text)  # not the forced form (an engine without a grammar): all content
            return out.result(final)
        rest = self._items(text, skip_ws(text, p + 1, len(text)), final, out)
        if rest is not None:
            out.text(text[rest if out.calls else p:])  # no call at all: the whole array is content
        return out.result(final)

    def _items(self, text: str, q: int, final: bool, out: ContentBuilder) -> int | None:
        """Reads the array's objects from ``q``: where trailing content starts, or None to stop."""
        n = len(text)
        while q < n:
            if text[q] == "]":
                return q + 1
            if text[q] != "{":
                return q
            obj = scan_object(text, q, n)
            # an object cut short (max_tokens) keeps the arguments it wrote, none yet: "", never an invented "{}"
            call = object_call(text, n, obj, self.tools, ARGUMENT_KEYS, complete=False)
            if call is not None:
                out.call(call)
            if obj.end is None:
                if obj.error_at is not None:
                    return obj.error_at if call is not None else q
                return q if call is None and final else None
            if call is None:
                return q
            q = skip_ws(text, obj.end, n)
            if q < n and text[q] == ",":
                q = skip_ws(text, q + 1, n)
                if q < n and text[q] == "]":
                    return q
        return None
