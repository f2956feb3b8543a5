"""Formats where each call sits between an opening and a closing tag (Qwen's ``<tool_call>``,
DeepSeek's and Kimi's special tokens): the scan shared by them, each family reading one call's body."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from pdserve.parsers.base import ContentBuilder, Scan, ToolCall, ToolParser, find_first, partial_marker_len


class TaggedToolParser(ToolParser):
    """``call_open`` BODY ``call_close``, anywhere in the text; ``section_tags`` (the tags some
    formats wrap a run of calls in) are layout and dropped, and so are ``stray_tags`` (a format's
    special tokens met outside a call: an argument marker, a lone end). A region whose body yields
    no call (``read_call`` None once the region is closed or the text final) is content, tags and
    all, unless ``unmatched_is_content`` is false: then it is dropped, as SGLang drops a call it
    cannot attribute, so that a format's special tokens never reach the content."""

    call_open: ClassVar[str]
    call_close: ClassVar[str]
    section_tags: ClassVar[tuple[str, ...]] = ()
    stray_tags: ClassVar[tuple[str, ...]] = ()
    unmatched_is_content: ClassVar[bool] = True

    @abstractmethod
    def read_call(self, body: str, complete: bool) -> ToolCall | None:
        """The call in a region's ``body`` (the text after ``call_open``; ``complete``: nothing more
        will come). None: no call, or not yet. Must hold to the module contract: once it returns a
        call for a body, it returns that call, its arguments only growing, for every longer body."""

    def scan(self, text: str, final: bool) -> Scan:
        out = ContentBuilder()
        markers = (self.call_open, *self.section_tags, *self.stray_tags)
        pos = 0
        while True:
            hit = find_first(text, markers, pos)
            if hit is None:
                tail = text[pos:]
                out.text(tail if final else tail[:len(tail) - partial_marker_len(tail, markers)])
                return out.result(final)
            at, tag = hit
            out.text(text[pos:at])
            if tag != self.call_open:
                out.boundary()
                pos = at + len(tag)
                continue
            end = self._region(text, at, final, out)
            if end is None:
                return out.result(final)
            pos = end

    def _region(self, text: str, at: int, final: bool, out: ContentBuilder) -> int | None:
        """Reads the region opening at ``at`` into ``out``; returns where the text goes on after
        it, or None when the region is still open (the scan stops there)."""
        body_start = at + len(self.call_open)
        close = text.find(self.call_close, body_start)
        if close >= 0:
            body_end, end = close, close + len(self.call_close)
        elif final:
            body_end = end = len(text)
        else:
            body_end = len(text) - partial_marker_len(text[body_start:], (self.call_close,))
            end = None
        call = self.read_call(text[body_start:body_end], complete=end is not None)
        if call is not None:
            out.call(call)
        elif end is not None:
            if self.unmatched_is_content:
                out.text(text[at:end])
            else:
                out.boundary()
        return end
