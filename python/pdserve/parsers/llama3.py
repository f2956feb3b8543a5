"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (``--tool-call-parser llama3``): the object the models'
chat template asks for, alone at the start of the reply or after the ``<|python_tag|>`` token,
several of them separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An object that is not a call of one of the request's tools is content, verbatim.
"""

from __future__ import annotations

from pdserve.parsers.base import ContentBuilder, Scan, ToolParser, find_first, partial_marker_len
from pdserve.parsers.json_scan import object_call, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3ToolParser(ToolParser):
    name = "llama3"

    def scan(self, text: str, final: bool) -> Scan:
        out = ContentBuilder()
        lead = skip_ws(text, 0, len(text))
        if lead == len(text) and not final:
            return out.result(final)  # whitespace so far: a call may start the reply
        pos: int | None = 0
        if lead < len(text) and text[lead] == "{":
            out.text(text[:lead])
            pos = self._calls(text, lead, final, out)
        while pos is not None:
            hit = find_first(text, (PYTHON_TAG,), pos)
            if hit is None:
                tail = text[pos:]
                out.text(tail if final else tail[:len(tail) - partial_marker_len(tail, (PYTHON_TAG,))])
                return out.result(final)
            at = hit[0]
            out.text(text[pos:at])
            q = skip_ws(text, at + len(PYTHON_TAG), len(text))
            if q == len(text) and not final:
                return out.result(final)  # the tag alone so far
            if q < len(text) and text[q] == "{":
                pos = self._calls(text, q, final, out, lead_in=text[at:q])
            else:
                out.text(PYTHON_TAG)  # not JSON after the tag (Llama's built-in tools write Python): content
                pos = at + len(PYTHON_TAG)
        return out.result(final)

    def _calls(self, text: str, start: int, final: bool, out: ContentBuilder, lead_in: str = "") -> int | None:
        """Reads ``{...}; {...}`` from ``start`` into ``out``: where content goes on, or None when
        the scan must stop (an object, or what follows one, still undecided). ``lead_in`` (the tag,
        a separator) is content if the object after it is no call."""
        q = start
        while True:
            obj = scan_object(text, q, len(text))
            call = object_call(text, len(text), obj, self.tools, ARGUMENT_KEYS, final)
            if call is not None:
                out.call(call)
            if obj.end is None and obj.error_at is None:  # still open
                if call is None and final:
                    out.text(lead_in + text[q:])
                return None
            if call is None:  # a closed or broken object that is no call: content
                end = obj.end if obj.end is not None else obj.error_at
                out.text(lead_in + text[q:end])
                return end
            if obj.end is None:
                return obj.error_at  # broken after its arguments: the rest is content
            nxt = _next_object(text, obj.end, final)
            if nxt is None or not nxt[1]:
                return None if nxt is None else nxt[0]
            lead_in, q = text[obj.end:nxt[0]], nxt[0]


def _next_object(text: str, end: int, final: bool) -> tuple[int, bool] | None:
    """After a call object ending at ``end``: (where the next object starts, True) after a ``;``,
    or (where content starts instead, False); None while that is undecided."""
    n = len(text)
    after = skip_ws(text, end, n)
    if after == n:
        return (end, False) if final else None
    if text[after] != ";":
        return end, False
    nxt = skip_ws(text, after + 1, n)
    if nxt == n:
        return (nxt, False) if final else None  # a dangling separator at the very end is dropped
    return (nxt, True) if text[nxt] == "{" else (end, False)
