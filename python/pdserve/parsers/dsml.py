"""DeepSeek-V3.2 (``--tool-call-parser deepseekv32``) and V4 (``deepseekv4``): DSML, XML-like tags
whose names carry the ``｜DSML｜`` token, one ``invoke`` per call and one ``parameter`` per argument:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

V4 names the section ``tool_calls``; either name is read by both. ``string="true"``: the value is
text (surrounding whitespace dropped); ``"false"``: JSON (text if it does not parse). The
arguments are the JSON object of those values, written as ``json.dumps`` writes it, and stream as
they come: a text value character by character, a JSON value once its tag closes. An invoke may
hold a JSON object instead of parameter tags, passed on as written. As in SGLang, the tags may
come without ``｜DSML｜`` (``<invoke name=...>``), an invoke of a function the request does not
offer is dropped, and a stray invoke end never reaches the content.
"""

from __future__ import annotations

import json
import re

from pdserve.parsers.base import ContentBuilder, Scan, ToolCall, ToolParser, partial_marker_len

_D = "(?:｜DSML｜)?"
_LAYOUT_OR_INVOKE = re.compile(rf"</?{_D}(?:function_calls|tool_calls)>|</{_D}invoke>|<{_D}invoke(?=[\s>])")
_INVOKE = re.compile(rf'<{_D}invoke\s+name="([^"]*)"\s*>')
# what an invoke tag may still become while it arrives (no ">" yet)
_INVOKE_PARTIAL = re.compile(rf'<{_D}invoke\s*(?:n(?:a(?:m(?:e(?:=(?:"[^"]*(?:"\s*)?)?)?)?)?)?)?')
_INVOKE_END = re.compile(rf"</{_D}invoke>")
_PARAM = re.compile(rf'<{_D}parameter\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>')
_PARAM_END = re.compile(rf"</{_D}parameter>")

_TAGS = [f"<{d}{n}>" for d in ("｜DSML｜", "") for n in ("function_calls", "tool_calls")]
MARKERS = (*_TAGS, *(t.replace("<", "</", 1) for t in _TAGS), '<｜DSML｜invoke name="', '<invoke name="',
           "</｜DSML｜invoke>", "</invoke>")
INVOKE_ENDS = ("</｜DSML｜invoke>", "</invoke>")
PARAM_ENDS = ("</｜DSML｜parameter>", "</parameter>")


class DeepSeekV32ToolParser(ToolParser):
    name = "deepseekv32"

    def scan(self, text: str, final: bool) -> Scan:
        out = ContentBuilder()
        pos = 0
        while True:
            m = _LAYOUT_OR_INVOKE.search(text, pos)
            if m is None:
                tail = text[pos:]
                out.text(tail if final else tail[:len(tail) - partial_marker_len(tail, MARKERS)])
                return out.result(final)
            out.text(text[pos:m.start()])
            if m.group().endswith(">"):
                out.boundary()  # a section tag, or a stray invoke end
                pos = m.end()
                continue
            nxt = self._invoke(text, m.start(), final, out)
            if nxt is None:
                return out.result(final)
            pos = nxt

    def _invoke(self, text: str, at: int, final: bool, out: ContentBuilder) -> int | None:
        """Reads the invoke opening at ``at``: where the text goes on after it, or None while it is open."""
        tag = _INVOKE.match(text, at)
        if tag is None:
            if not final and _INVOKE_PARTIAL.fullmatch(text, at):
                return None  # the tag is still arriving
            out.text(text[at])  # "<invoke" that is no tag: content
            return at + 1
        close = _INVOKE_END.search(text, tag.end())
        if close is not None:
            body, end = text[tag.end():close.start()], close.end()
        elif final:
            body, end = text[tag.end():], len(text)
        else:
            body = text[tag.end():]
            body, end = body[:len(body) - partial_marker_len(body, INVOKE_ENDS)], None
        name = tag.group(1).strip()
        if name in self.tools:
            out.call(ToolCall(name, arguments(body, closed=close is not None, final=final)))
        else:
            out.boundary()
        return end


def arguments(body: str, closed: bool, final: bool) -> str:
    """The JSON arguments of an invoke's ``body`` so far (``closed``: its end tag came)."""
    lead = body.lstrip()
    if lead.startswith("{"):
        return body.strip()  # the JSON form, as written
    if not lead:
        return "{}" if closed or final else ""
    members, pending = _parameters(body, closed, final)
    text = "{" + ", ".join(members)
    if pending is not None:
        text += (", " if members else "") + pending
    return text + "}" if closed else text


def _parameters(body: str, closed: bool, final: bool) -> tuple[list[str], str | None]:
    """The members of the parameters complete in ``body`` (``"name": value``, first of each name),
    and the one still open as far as it is certain, if any. ``closed``: the invoke ended (a
    parameter left open ends with it); ``final``: the output did (one left open was cut short,
    and its value is passed on as written, like any cut call)."""
    members: list[str] = []
    seen: set[str] = set()
    p = 0
    while (m := _PARAM.search(body, p)) is not None:
        key, is_text = m.group(1), m.group(2) == "true"
        close = _PARAM_END.search(body, m.end())
        end = close.start() if close is not None else len(body)
        if close is None and not closed:
            return members, None if key in seen else _open_member(key, body[m.end():], is_text, final)
        if key not in seen:
            seen.add(key)
            members.append(json.dumps(key, ensure_ascii=False) + ": " + _value(body[m.end():end], is_text))
        if close is None:
            break
        p = close.end()
    return members, None


def _open_member(key: str, value: str, is_text: bool, final: bool) -> str:
    head = json.dumps(key, ensure_ascii=False) + ": "
    if not final:
        value = value[:len(value) - partial_marker_len(value, PARAM_ENDS)]
    if is_text:
        return head + json.dumps(value.strip(), ensure_ascii=False)[:-1]  # escaping is per character
    return head + value.strip() if final else head  # a JSON value is known once its tag closes


def _value(raw: str, is_text: bool) -> str:
    value = raw.strip()
    if not is_text:
        try:
            return json.dumps(json.loads(value, parse_constant=_no_constant), ensure_ascii=False)
        except ValueError:
            pass  # not JSON: the model's text, as a string
    return json.dumps(value, ensure_ascii=False)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    name = "deepseekv4"
