"""DeepSeek's tool-call syntaxes (its special tokens, written with full-width bars):

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                  ```json
                  {...arguments...}
                  ```<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>       (DeepSeek-V3, R1)
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...arguments...}
                  <｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>           (DeepSeek-V3.1)

after optional text.
"""

from __future__ import annotations

import re

from vmkv.server.tool_parsers.base import MarkedParser
from vmkv.server.tool_parsers.json_stream import WAIT, JsonCallsReader

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3Parser(MarkedParser):
    name = "deepseek_v3"
    MARKERS = (CALLS_BEGIN,)
    HEADER = re.compile(rf"function{SEP}([^\n]+)\n```json\n")

    def reader(self) -> JsonCallsReader:
        return _HeaderReader(self, (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, "```"))


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    HEADER = re.compile(rf"([^\n<]+?){SEP}")


class _HeaderReader(JsonCallsReader):
    """Calls whose name stands before their JSON arguments (``parser.HEADER``)."""

    def __init__(self, parser: DeepSeekV3Parser, separators: tuple[str, ...]) -> None:
        super().__init__(separators)
        self.pattern = parser.HEADER

    def header(self, text: str) -> tuple[str, int] | object | None:
        found = self.pattern.match(text)
        if found is not None:
            return found.group(1).strip(), found.end()
        if len(text) < 256 and "\n```json\n" not in text and not text.startswith("{"):
            return WAIT  # the name's line may still be coming
        return None
