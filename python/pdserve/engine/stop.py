"""Stop strings found incrementally: each token decodes only the output's newest tokens.

Decoding a request's whole output every step costs O(output) per token; this
keeps the last ``len(longest stop) - 1`` characters of text already checked and
decodes a short window of tokens, so a step's cost does not grow with the output.
"""

from __future__ import annotations

# Tokens still not forming a complete character after this many are taken as they
# decode (with U+FFFD): a UTF-8 character is at most 4 bytes, so such bytes are invalid
# and will never complete; waiting longer would only make the window grow.
MAX_PENDING_TOKENS = 8


class StopStringMatcher:
    """Reports the first of ``stop`` (in list order) to appear in the decoded output.

    Gives the same answer, at the same token, as decoding the whole output each step
    and testing ``s in text``: a stop string spanning tokens is found when its last
    character arrives, and bytes of a character split over tokens are decoded together.

    Like ``IncrementalDetokenizer``, it decodes ``ids[prefix_offset:]`` and
    ``ids[prefix_offset:read_offset]`` and takes the difference, so that tokenizers whose
    text depends on the previous token (leading spaces, cleanup) decode as in full.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        if not stop:
            raise ValueError("stop: the matcher needs at least one stop string")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip = skip_special_tokens
        self.keep = max(map(len, self.stop)) - 1  # checked chars a stop string can still end after
        self.prefix_offset = 0  # decoding starts here (one window back, for context)
        self.read_offset = 0  # tokens before this are checked text
        self.tail = ""  # the last ``keep`` characters of checked text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def check(self, output_ids: list[int]) -> str | None:
        """Call after each new token with the whole output so far (only its end is read)."""
        before = self._decode(output_ids[self.prefix_offset:self.read_offset])
        pending = self._decode(output_ids[self.prefix_offset:])[len(before):]  # text of the new tokens
        window = self.tail + pending
        hit = next((s for s in self.stop if s in window), None)
        incomplete = pending.endswith("\ufffd") and len(output_ids) - self.read_offset < MAX_PENDING_TOKENS
        if not incomplete:  # the new tokens' text is final: it becomes checked text
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
            self.tail = window[-self.keep:] if self.keep else ""
        return hit
