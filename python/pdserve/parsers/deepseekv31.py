"""DeepSeek-V3.1 (``--tool-call-parser deepseekv31``): V3's special tokens, but the name right
after the call token and the arguments as bare JSON, no fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The arguments stream as they come. As in SGLang, a call of a function the request does not offer
is dropped, and a lone end token outside a call never reaches the content.
"""

from __future__ import annotations

from pdserve.parsers.base import ToolCall
from pdserve.parsers.deepseekv3 import SEP
from pdserve.parsers.tagged import TaggedToolParser


class DeepSeekV31ToolParser(TaggedToolParser):
    name = "deepseekv31"
    call_open = "<｜tool▁call▁begin｜>"
    call_close = "<｜tool▁call▁end｜>"
    section_tags = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    stray_tags = ("<｜tool▁call▁end｜>",)
    unmatched_is_content = False

    def read_call(self, body: str, complete: bool) -> ToolCall | None:
        sep = body.find(SEP)
        if sep < 0:
            return None
        name = body[:sep].strip()
        if name not in self.tools:
            return None
        args = body[sep + len(SEP):].strip()
        return ToolCall(name, args or ("{}" if complete else ""))
