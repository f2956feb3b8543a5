"""DeepSeek-V3 / R1 (``--tool-call-parser deepseekv3``): the calls DeepSeek's chat template renders,
in its special tokens, the arguments as a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(more calls follow the first's ``<｜tool▁call▁end｜>``, usually after a newline).
"""

from __future__ import annotations

from pdserve.parsers.base import ToolCall, partial_marker_len
from pdserve.parsers.tagged import TaggedToolParser

SEP = "<｜tool▁sep｜>"
FENCE = "```json"
FENCE_END = "\n```"  # a raw newline cannot occur inside a JSON string, so this ends the arguments


class DeepSeekV3ToolParser(TaggedToolParser):
    name = "deepseekv3"
    call_open = "<｜tool▁call▁begin｜>"
    call_close = "<｜tool▁call▁end｜>"
    section_tags = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

    def read_call(self, body: str, complete: bool) -> ToolCall | None:
        sep = body.find(SEP)
        if sep < 0:
            return None
        line_end = body.find("\n", sep)
        if line_end < 0 and not complete:
            return None  # the name may still grow
        name = body[sep + len(SEP):line_end if line_end >= 0 else len(body)].strip()
        if name not in self.tools:
            return None
        rest = body[line_end + 1:] if line_end >= 0 else ""
        return ToolCall(name, _arguments(rest, complete))


def _arguments(rest: str, complete: bool) -> str:
    """The JSON inside the fence (or the bare text, if the model left the fence out)."""
    if rest.startswith(FENCE):
        rest = rest[len(FENCE):]
    elif not complete and FENCE.startswith(rest):
        return ""  # the fence is still arriving
    end = rest.find(FENCE_END)
    if end >= 0:
        rest = rest[:end]
    elif not complete:
        rest = rest[:len(rest) - partial_marker_len(rest, (FENCE_END,))]
    args = rest.strip()
    return args or ("{}" if complete else "")
