"""Reasoning split out of a reply (``--reasoning-parser``), as vLLM's reasoning parsers split
it: the thinking goes to ``reasoning`` (and ``reasoning_content``), the rest to ``content``.

A parser knows the markers that open and close the thinking (``<think>`` / ``</think>``, or
Granite's "Here is my thought process:" / "Here is my response:"). Reading a reply:

  * leading whitespace and an opening marker at its start are dropped; without an opening
    marker the reply is reasoning from its first character (DeepSeek-R1 and Qwen3 templates
    put ``<think>`` in the prompt), or all content where the parser needs the marker (granite);
  * the first closing marker ends the reasoning: what follows is content (None if nothing);
  * a reply that never closes it is all reasoning (it was cut short, or still thinking).

:class:`ReasoningStream` does the same as the reply arrives, holding back only a tail that may
still become a marker, so the streamed deltas add up to the non-streamed split (``split`` is
the stream run over the whole reply). A request whose prompt already closed the thinking
(``enable_thinking: false`` templates end the prompt with ``<think></think>``) gets no parser:
its reply is content, and structured outputs apply from its first token; otherwise they apply
after the closing token (``SamplingParams.structured_outputs_after``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class ReasoningParser:
    """One request's reasoning parser (subclasses name their markers).

    Attributes:
        STARTS / ENDS: the texts that open / close the thinking.
        NEEDS_START: without an opening marker at its start, the reply is all content.
        start_id / end_id: the markers' token ids where each is one token of the tokenizer
            (None otherwise): they find the end in token ids (structured outputs, a prompt
            that closed the thinking, the reasoning token count).
    """

    name: ClassVar[str]
    STARTS: ClassVar[tuple[str, ...]]
    ENDS: ClassVar[tuple[str, ...]]
    NEEDS_START: ClassVar[bool] = False
    #: the markers must each be one token of the tokenizer (ValueError otherwise)
    NEEDS_TOKENS: ClassVar[bool] = True

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        self.start_id = vocab.get(self.STARTS[0]) if len(self.STARTS) == 1 else None
        self.end_id = vocab.get(self.ENDS[0]) if len(self.ENDS) == 1 else None
        if self.NEEDS_TOKENS and (self.start_id is None or self.end_id is None):
            raise ValueError(f"the {self.name} reasoning parser needs {self.STARTS[0]} and "
                             f"{self.ENDS[0]} as tokens of the tokenizer, which has "
                             f"{'neither' if self.start_id is None else 'not ' + self.ENDS[0]}")
        self.markers = self.STARTS + self.ENDS

    def thinks(self, prompt_ids: Sequence[int], template_kwargs: dict[str, Any]) -> bool:
        """Whether the reply of a request with this prompt begins with thinking: not when the
        prompt's last marker token closes it (vLLM's ``is_reasoning_end`` on the prompt)."""
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return True
            if token == self.end_id:
                return False
        return True

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole reply."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text, finished=True)
        return (reasoning if stream.opened else None), (content or None)

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of a reply's tokens are reasoning: those before the closing token (the
        opening one not counted); 0 where the closing marker is not one token."""
        if self.end_id is None:
            return 0
        count = 0
        for token in token_ids:
            if token == self.end_id:
                break
            count += token != self.start_id
        return count


class ReasoningStream:
    """One choice's reply as it arrives: ``feed(text, finished)`` returns the
    ``(reasoning, content)`` deltas it completes (either may be empty). ``opened``: the reply
    began with thinking."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = "start"  # start | reasoning | content
        self.held = ""  # text not yet given out
        self.opened = False

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        held = self.held + text
        self.held = ""
        if self.state == "start":
            held = self._start(held, finished)
            if self.state == "start":
                return "", ""
        if self.state == "content":
            return "", held
        return self._reasoning(held, finished)

    def _start(self, text: str, finished: bool) -> str:
        """Read the reply's opening; the text left once the state is known."""
        parser = self.parser
        stripped = text.lstrip()
        for marker in parser.STARTS:
            if stripped.startswith(marker):
                self.state, self.opened = "reasoning", True
                return stripped[len(marker):]
        if not finished and (not stripped or any(m.startswith(stripped) for m in parser.STARTS)):
            self.held = text  # it may still become the opening
            return ""
        if parser.NEEDS_START:
            self.state = "content"
        else:
            self.state, self.opened = "reasoning", True
        return text

    def _reasoning(self, text: str, finished: bool) -> tuple[str, str]:
        ends = [(at, m) for m in self.parser.ENDS if (at := text.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self.state = "content"
            return text[:at], text[at + len(marker):]
        keep = 0 if finished else max(_marker_tail(text, m) for m in self.parser.ENDS)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""


def _marker_tail(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
